"""Per-tenant quotas: requests in flight and requests per minute, answered 429 with Retry-After.

One process keeps the counts in memory; with Redis configured every replica shares them, so N
replicas still give a tenant one quota, not N. A tenant over its quota waits; the others never
notice it.
"""

import asyncio
import math
import secrets
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field

from gateway.errors import APIError

WINDOW_S = 60.0
# A replica that dies holding a slot must not hold it forever: Redis forgets it after this.
SLOT_LEASE_S = 900.0


class QuotaExceeded(APIError):
    def __init__(self, message: str, retry_after: int):
        super().__init__(
            429,
            message,
            type="rate_limit_error",
            code="tenant_quota_exceeded",
            headers={"Retry-After": str(max(1, retry_after))},
        )


@dataclass(slots=True)
class Slot:
    """One admitted request; `release` is idempotent (streams end along several paths)."""

    quotas: "Quotas"
    tenant_id: str
    token: str
    released: bool = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self.quotas.release(self)


@dataclass(slots=True)
class Quotas(ABC):
    max_concurrent: int  # 0 = no limit
    per_minute: int  # 0 = no limit

    @abstractmethod
    async def admit(self, tenant_id: str) -> Slot:
        """A slot for one request, or QuotaExceeded."""

    @abstractmethod
    async def release(self, slot: Slot) -> None:
        """Give the slot back."""

    def refuse_concurrency(self) -> QuotaExceeded:
        return QuotaExceeded(
            f"this tenant already has {self.max_concurrent} requests in flight", retry_after=1
        )

    def refuse_rate(self, retry_after: float) -> QuotaExceeded:
        return QuotaExceeded(
            f"this tenant is over its {self.per_minute} requests per minute",
            retry_after=math.ceil(retry_after),
        )


@dataclass(slots=True)
class MemoryQuotas(Quotas):
    in_flight: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    admitted: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    async def admit(self, tenant_id: str) -> Slot:
        now = time.monotonic()
        if self.max_concurrent and len(self.in_flight[tenant_id]) >= self.max_concurrent:
            raise self.refuse_concurrency()
        if self.per_minute:
            recent = [t for t in self.admitted[tenant_id] if t > now - WINDOW_S]
            self.admitted[tenant_id] = recent
            if len(recent) >= self.per_minute:
                raise self.refuse_rate(recent[0] + WINDOW_S - now)
            recent.append(now)
        slot = Slot(self, tenant_id, secrets.token_hex(8))
        self.in_flight[tenant_id].add(slot.token)
        return slot

    async def release(self, slot: Slot) -> None:
        self.in_flight[slot.tenant_id].discard(slot.token)


# Both checks and the admission in one round trip, atomically: two replicas never both take
# the last slot. Sorted sets hold (member, time): stale members fall out by score.
ADMIT_SCRIPT = """
local in_flight, admitted = KEYS[1], KEYS[2]
local now, lease, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_concurrent, per_minute, token = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
redis.call('ZREMRANGEBYSCORE', in_flight, '-inf', now - lease)
if max_concurrent > 0 and redis.call('ZCARD', in_flight) >= max_concurrent then
  return {1, 0}
end
if per_minute > 0 then
  redis.call('ZREMRANGEBYSCORE', admitted, '-inf', now - window)
  if redis.call('ZCARD', admitted) >= per_minute then
    local oldest = redis.call('ZRANGE', admitted, 0, 0, 'WITHSCORES')
    return {2, tostring(tonumber(oldest[2]) + window - now)}
  end
  redis.call('ZADD', admitted, now, token)
  redis.call('EXPIRE', admitted, math.ceil(window) + 1)
end
redis.call('ZADD', in_flight, now, token)
redis.call('EXPIRE', in_flight, math.ceil(lease) + 1)
return {0, 0}
"""


@dataclass(slots=True)
class RedisQuotas(Quotas):
    url: str = ""
    client: object = None

    def __post_init__(self) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(self.url)

    @staticmethod
    def keys(tenant_id: str) -> list[str]:
        return [f"inherent:quota:{tenant_id}:in_flight", f"inherent:quota:{tenant_id}:admitted"]

    async def admit(self, tenant_id: str) -> Slot:
        token = secrets.token_hex(8)
        verdict, wait = await self.client.eval(
            ADMIT_SCRIPT, 2, *self.keys(tenant_id), time.time(), SLOT_LEASE_S, WINDOW_S,
            self.max_concurrent, self.per_minute, token,
        )
        if int(verdict) == 1:
            raise self.refuse_concurrency()
        if int(verdict) == 2:
            raise self.refuse_rate(float(wait))
        return Slot(self, tenant_id, token)

    async def release(self, slot: Slot) -> None:
        await asyncio.shield(self.client.zrem(self.keys(slot.tenant_id)[0], slot.token))


def quotas_for(max_concurrent: int, per_minute: int, redis_url: str) -> Quotas:
    if redis_url:
        return RedisQuotas(max_concurrent, per_minute, url=redis_url)
    return MemoryQuotas(max_concurrent, per_minute)

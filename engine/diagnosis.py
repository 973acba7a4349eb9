"""Which phase makes a window of requests slow, with the numbers behind the verdict.

"It's slow" is two complaints: a long wait for the first token (TTFT = queue + prefill) and a
stuttering stream (TPOT = pure decode + interference from other requests' prefills sharing the
step). This splits each one into its causes and names the phase that dominates, from either of
the two places the numbers live:

- timeline summaries (`RequestTimeline.summary()` dicts: `RequestOutput.metrics`, a receipt's
  timeline, a bench result file): per request, so the slowest tail can be split on its own;
- a live `/metrics` endpoint: the engine's Prometheus histograms (`engine/metrics.py`), whose
  sums give the same split over every request the server finished.

It needs no engine, only the standard library and prometheus_client's parser.
"""

import json
import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PHASES = ("queue", "prefill", "decode", "interference")
TTFT_PHASES = ("queue", "prefill")
TPOT_PHASES = ("decode", "interference")

# What to look at when a phase is the cause.
REMEDIES = {
    "queue": "admission: requests wait behind earlier prompts' prefill or for seats/KV blocks"
             " (capacity, admission policy)",
    "prefill": "prompt compute (prefill speed, chunk budget)",
    "decode": "decode speed (memory bandwidth, batch size)",
    "interference": "chunk prefills smaller or disaggregate prefill",
}

METRICS_PREFIX = "inherent:"
# The engine's per-request histograms (engine/metrics.py) behind each phase.
PHASE_HISTOGRAMS = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
    "interference": "request_interference_time_seconds",
}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _split(summary: dict) -> dict[str, float]:
    interference = summary.get("interference_time") or 0.0
    return {
        "queue": summary.get("queue_time") or 0.0,
        "prefill": summary.get("prefill_time") or 0.0,
        "decode": max(0.0, (summary.get("decode_time") or 0.0) - interference),
        "interference": interference,
    }


def _total(parts: list[dict[str, float]]) -> dict[str, float]:
    return {p: sum(part[p] for part in parts) for p in PHASES}


def _shares(totals: dict[str, float], phases: tuple[str, ...]) -> dict[str, float]:
    whole = sum(totals[p] for p in phases)
    return {p: (totals[p] / whole if whole else 0.0) for p in phases}


def _cause(shares: dict[str, float]) -> str:
    return max(shares, key=lambda p: shares[p])


def _tail(summaries: list[dict], key: str, q: float) -> list[dict]:
    """The requests at or above the q-th percentile of `key`."""
    cut = percentile([s[key] for s in summaries], q)
    return [s for s in summaries if s[key] >= cut]


def diagnose(summaries: list[dict], tail_percentile: float = 90.0) -> dict:
    """Verdict on a window of finished requests (summaries without a first token are
    ignored). Times are in seconds; shares are fractions of the metric they split."""
    done = [s for s in summaries if s.get("ttft") is not None]
    report: dict = {"num_requests": len(done)}
    if not done:
        report["verdict"] = "no request produced a token in this window"
        return report
    itl = [gap for s in done for gap in s.get("itl", ())]
    with_tpot = [s for s in done if s.get("tpot") is not None]
    totals = _total([_split(s) for s in done])
    ttft_tail = _total([_split(s) for s in _tail(done, "ttft", tail_percentile)])
    report["ttft"] = {
        "p50": percentile([s["ttft"] for s in done], 50),
        "p99": percentile([s["ttft"] for s in done], 99),
        "share": _shares(totals, TTFT_PHASES),
        "tail_share": _shares(ttft_tail, TTFT_PHASES),
    }
    report["ttft"]["cause"] = _cause(report["ttft"]["tail_share"])
    decoding = _total([_split(s) for s in with_tpot])
    report["tpot"] = {
        "p50": percentile([s["tpot"] for s in with_tpot], 50),
        "p99": percentile([s["tpot"] for s in with_tpot], 99),
        "itl_p99": percentile(itl, 99),
        "share": _shares(decoding, TPOT_PHASES),
        "tail_share": {},
        "interference_steps_per_request": (
            sum(s.get("interference_steps", 0) for s in with_tpot) / len(with_tpot)
            if with_tpot else 0.0
        ),
    }
    if with_tpot:
        tpot_tail = _total([_split(s) for s in _tail(with_tpot, "tpot", tail_percentile)])
        report["tpot"]["tail_share"] = _shares(tpot_tail, TPOT_PHASES)
        report["tpot"]["cause"] = _cause(report["tpot"]["tail_share"])
    report["totals"] = totals
    report["dominant"] = _cause(totals)
    report["verdict"] = _verdict(report)
    return report


def _verdict(report: dict) -> str:
    ttft = report["ttft"]
    lines = [
        f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms: "
        f"{ttft['share']['queue']:.0%} waiting in the queue, {ttft['share']['prefill']:.0%} "
        f"prefill; in the slowest tail {ttft['tail_share'][ttft['cause']]:.0%} is "
        f"{ttft['cause']} -> {REMEDIES[ttft['cause']]}"
    ]
    tpot = report["tpot"]
    if tpot["p50"] is not None:
        lines.append(
            f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms, ITL p99 "
            f"{tpot['itl_p99'] * 1e3:.1f} ms: {tpot['share']['interference']:.0%} of decode "
            f"time is interference from prefills sharing the step "
            f"({tpot['interference_steps_per_request']:.1f} such steps per request); in the "
            f"slowest tail {tpot['tail_share'][tpot['cause']]:.0%} is {tpot['cause']} -> "
            f"{REMEDIES[tpot['cause']]}"
        )
    lines.append(_dominant_line(report["totals"]))
    return "\n".join(lines)


def _dominant_line(totals: dict[str, float]) -> str:
    whole = sum(totals.values())
    if not whole:
        return "No time recorded."
    dominant = _cause(totals)
    return (f"Dominant phase over all request time: {dominant} "
            f"({totals[dominant] / whole:.0%} of {whole:.1f} s)")


# --- the two inputs ------------------------------------------------------------------------------


def from_file(path: Path) -> dict[str, dict[str, Any]]:
    """Reports on a bench result file: a JSON list of summaries, or an object of named lists
    (e.g. one per bench mode)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    windows = {"requests": data} if isinstance(data, list) else data
    if not isinstance(windows, dict) or not all(isinstance(v, list) for v in windows.values()):
        raise ValueError("expected a JSON list of request summaries or an object of such lists")
    return {name: diagnose(summaries) for name, summaries in windows.items()}


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Quantile from cumulative histogram buckets [(upper bound, count)], linear within a bucket."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (
                (rank - below) / (count - below) if count > below else 1.0
            )
        lower, below = upper, count
    return lower


def from_metrics(text: str) -> dict[str, Any]:
    """The same split as ``diagnose`` from the engine's Prometheus histograms: their sums give
    each phase's time over every finished request, their buckets estimate p50 and p99."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(METRICS_PREFIX)
            if name.endswith("_sum"):
                metric = name.removesuffix("_sum")
                sums[metric] = sums.get(metric, 0.0) + sample.value
            elif name.endswith("_bucket"):
                buckets.setdefault(name.removesuffix("_bucket"), []).append(
                    (float(sample.labels["le"]), sample.value)
                )
    if "time_to_first_token_seconds" not in buckets:
        raise ValueError(f"no {METRICS_PREFIX}time_to_first_token_seconds histogram: "
                         "is this an Inherent /metrics endpoint?")
    totals = {phase: sums.get(metric, 0.0) for phase, metric in PHASE_HISTOGRAMS.items()}
    totals["decode"] = max(0.0, totals["decode"] - totals["interference"])

    def spread(metric: str, phases: tuple[str, ...]) -> dict[str, Any]:
        series = sorted(buckets.get(metric, []))
        share = _shares(totals, phases)
        return {"p50": quantile(series, 0.5), "p99": quantile(series, 0.99), "share": share,
                "cause": _cause(share)}

    ttft = spread("time_to_first_token_seconds", TTFT_PHASES)
    tpot = spread("request_time_per_output_token_seconds", TPOT_PHASES)
    lines = []
    if ttft["p50"] is not None:
        lines.append(
            f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms (bucket "
            f"estimates): mostly {ttft['cause']} ({totals[ttft['cause']]:.1f} s of "
            f"{totals['queue'] + totals['prefill']:.1f} s) -> {REMEDIES[ttft['cause']]}"
        )
    if tpot["p50"] is not None:
        lines.append(
            f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms: mostly "
            f"{tpot['cause']} ({totals[tpot['cause']]:.1f} s of "
            f"{totals['decode'] + totals['interference']:.1f} s decode time) -> "
            f"{REMEDIES[tpot['cause']]}"
        )
    lines.append(_dominant_line(totals))
    return {
        "ttft": ttft,
        "tpot": tpot,
        "totals": totals,
        "share": _shares(totals, PHASES),
        "dominant": _cause(totals),
        "verdict": "\n".join(lines),
    }


def scrape(url: str, token: str | None = None, timeout: float = 30) -> str:
    """The Prometheus text at `url`, sent `token` as a bearer token; a refusal or an unreachable
    server becomes a ValueError that says which."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{exc.code} {exc.reason} from {url}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ValueError(f"cannot reach {url}: {reason}") from exc


def from_source(source: str, token: str | None = None) -> dict[str, dict[str, Any]]:
    """Reports by window name: a metrics URL (http:// or https://) gives one, named by the URL;
    a bench result file one per window it holds. Bad input raises ValueError."""
    if source.startswith(("http://", "https://")):
        return {source: from_metrics(scrape(source, token))}
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"no such file: {source}")
    return from_file(path)

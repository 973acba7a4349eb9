"""Inputs for ``inherent diagnose``: a bench result file (per-request timeline summaries) or a
live ``/metrics`` endpoint (the engine's histograms), turned into a phase verdict."""

import json
import math
from pathlib import Path
from typing import Any

from engine.diagnosis import PHASES, diagnose

PREFIX = "inherent:"
PHASE_HISTOGRAMS = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
    "interference": "request_interference_time_seconds",
}


def from_file(path: Path) -> dict[str, dict[str, Any]]:
    """A JSON list of summaries, or an object of named lists (e.g. one per bench mode)."""
    data = json.loads(path.read_text())
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
    """The same split as ``diagnose`` from the engine's Prometheus histograms (sums and buckets)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name.endswith("_sum"):
                sums[name.removesuffix("_sum")] = (
                    sums.get(name.removesuffix("_sum"), 0.0) + sample.value
                )
            elif name.endswith("_bucket"):
                buckets.setdefault(name.removesuffix("_bucket"), []).append(
                    (float(sample.labels["le"]), sample.value)
                )
    if "time_to_first_token_seconds" not in buckets:
        raise ValueError(
            "no inherent:time_to_first_token_seconds histogram: is this an Inherent /metrics endpoint?"
        )
    totals = {phase: sums.get(metric, 0.0) for phase, metric in PHASE_HISTOGRAMS.items()}
    totals["decode"] = max(0.0, totals["decode"] - totals["interference"])

    def pair(metric: str) -> dict[str, float | None]:
        series = sorted(buckets.get(metric, []))
        return {"p50": quantile(series, 0.5), "p99": quantile(series, 0.99)}

    ttft, tpot = pair("time_to_first_token_seconds"), pair("request_time_per_output_token_seconds")
    whole = sum(totals.values())
    share = {p: (totals[p] / whole if whole else 0.0) for p in PHASES}
    ttft_cause = max(("queue", "prefill"), key=lambda p: totals[p])
    tpot_cause = max(("decode", "interference"), key=lambda p: totals[p])
    dominant = max(PHASES, key=lambda p: totals[p])
    lines = []
    if ttft["p50"] is not None:
        lines.append(
            f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms (bucket estimates): mostly {ttft_cause} "
            f"({totals[ttft_cause]:.1f} s of {totals['queue'] + totals['prefill']:.1f} s)"
        )
    if tpot["p50"] is not None:
        lines.append(
            f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms: mostly {tpot_cause} "
            f"({totals[tpot_cause]:.1f} s of {totals['decode'] + totals['interference']:.1f} s decode time)"
        )
    lines.append(
        f"Dominant phase over all request time: {dominant} ({share[dominant]:.0%})"
        if whole
        else "No time recorded."
    )
    return {
        "ttft": {**ttft, "cause": ttft_cause},
        "tpot": {**tpot, "cause": tpot_cause},
        "totals": totals,
        "share": share,
        "dominant": dominant,
        "verdict": "\n".join(lines),
    }

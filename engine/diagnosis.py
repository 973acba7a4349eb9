"""Which phase makes a window of requests slow, with the numbers behind the verdict.

"It's slow" is two complaints: a long wait for the first token (TTFT = queue + prefill) and a
stuttering stream (TPOT = pure decode + interference from other requests' prefills sharing the
step). This splits each one into its causes, over all requests and over the slowest tail, and
names the phase that dominates. It reads timeline summaries (`RequestTimeline.summary()`
dicts, e.g. `RequestOutput.metrics` or a bench result file), so it needs no engine.
"""

import math

PHASES = ("queue", "prefill", "decode", "interference")


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


def _shares(parts: list[dict[str, float]], phases: tuple[str, ...]) -> dict[str, float]:
    totals = {p: sum(part[p] for part in parts) for p in phases}
    whole = sum(totals.values())
    return {p: (totals[p] / whole if whole else 0.0) for p in phases}


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
    parts = [_split(s) for s in done]
    totals = {p: sum(part[p] for part in parts) for p in PHASES}
    ttft_tail = _tail(done, "ttft", tail_percentile)
    report["ttft"] = {
        "p50": percentile([s["ttft"] for s in done], 50),
        "p99": percentile([s["ttft"] for s in done], 99),
        "share": _shares(parts, ("queue", "prefill")),
        "tail_share": _shares([_split(s) for s in ttft_tail], ("queue", "prefill")),
    }
    report["tpot"] = {
        "p50": percentile([s["tpot"] for s in with_tpot], 50),
        "p99": percentile([s["tpot"] for s in with_tpot], 99),
        "itl_p99": percentile(itl, 99),
        "share": _shares([_split(s) for s in with_tpot], ("decode", "interference")),
        "tail_share": (
            _shares([_split(s) for s in _tail(with_tpot, "tpot", tail_percentile)],
                    ("decode", "interference"))
            if with_tpot else {}
        ),
        "interference_steps_per_request": (
            sum(s.get("interference_steps", 0) for s in with_tpot) / len(with_tpot)
            if with_tpot else 0.0
        ),
    }
    report["totals"] = totals
    report["dominant"] = max(PHASES, key=lambda p: totals[p])
    report["ttft"]["cause"] = max(("queue", "prefill"),
                                  key=lambda p: report["ttft"]["tail_share"][p])
    if with_tpot:
        tail = report["tpot"]["tail_share"]
        report["tpot"]["cause"] = max(("decode", "interference"), key=lambda p: tail[p])
    report["verdict"] = _verdict(report)
    return report


def _verdict(report: dict) -> str:
    ttft = report["ttft"]
    lines = [
        f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms: "
        f"{ttft['share']['queue']:.0%} waiting in the queue, {ttft['share']['prefill']:.0%} "
        f"prefill; in the slowest tail {ttft['tail_share'][ttft['cause']]:.0%} is "
        f"{ttft['cause']} -> "
        + ("admission: requests wait behind earlier prompts' prefill or for seats/KV blocks"
           " (capacity, admission policy)"
           if ttft["cause"] == "queue" else "prompt compute (prefill speed, chunk budget)")
    ]
    tpot = report["tpot"]
    if tpot["p50"] is not None:
        lines.append(
            f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms, ITL p99 "
            f"{tpot['itl_p99'] * 1e3:.1f} ms: {tpot['share']['interference']:.0%} of decode "
            f"time is interference from prefills sharing the step "
            f"({tpot['interference_steps_per_request']:.1f} such steps per request); in the "
            f"slowest tail {tpot['tail_share'][tpot['cause']]:.0%} is {tpot['cause']} -> "
            + ("chunk prefills smaller or disaggregate prefill"
               if tpot["cause"] == "interference"
               else "decode speed (memory bandwidth, batch size)")
        )
    totals = report["totals"]
    whole = sum(totals.values())
    lines.append(
        f"Dominant phase over all request time: {report['dominant']} "
        f"({totals[report['dominant']] / whole:.0%} of {whole:.1f} s)"
        if whole else "No time recorded."
    )
    return "\n".join(lines)

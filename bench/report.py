"""Figures, markdown tables and PNG plots for the fleet benchmark and the scale simulation.

The report file holds generated sections between markers (``<!-- fleet:begin -->`` ...
``<!-- fleet:end -->``, ``<!-- simulate:begin -->`` ...), so each command rewrites only its
own part and hand-written text around them survives.

    python -m bench.report --results /tmp/bench-fleet/results.json --report docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "fleet_markdown",
    "load_share_series",
    "percentile",
    "summarize",
    "write_fleet_report",
    "write_section",
]

POLICY_LABEL = {
    "prefix": "prefix (router)",
    "prefix_no_pending": "prefix, no pending",
    "round_robin": "round robin",
    "least_loaded": "least loaded",
    "oracle": "upper bound",
}


def percentile(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (NaN for no data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def _records(run: Any) -> list[dict[str, Any]]:
    recs = run["records"] if isinstance(run, dict) else run.records
    return [asdict(r) if is_dataclass(r) else dict(r) for r in recs]


def _policy(run: Any) -> str:
    return run["policy"] if isinstance(run, dict) else run.policy


def _cpu(run: Any) -> dict[str, Any]:
    return (run.get("cpu") if isinstance(run, dict) else run.cpu) or {}


def in_flight_seconds(recs: Iterable[dict[str, Any]], engines: int) -> list[float]:
    """Request-seconds spent in flight on each engine (the integral of its in-flight count)."""
    out = [0.0] * engines
    for r in recs:
        e = r.get("engine", -1)
        if 0 <= e < engines and r.get("t_end", 0) > r.get("t_send", 0):
            out[e] += r["t_end"] - r["t_send"]
    return out


def summarize(run: Any, engines: int) -> dict[str, Any]:
    """The table row of one policy run."""
    recs = _records(run)
    ok = [r for r in recs if r.get("status") == 200 and not r.get("error")]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached") or 0 for r in ok)
    ttft = [r["ttft"] * 1000 for r in ok if r.get("ttft") is not None]
    e2e = [r["e2e"] * 1000 for r in ok if r.get("e2e") is not None]
    span = (max(r["t_end"] for r in ok) - min(r["t_send"] for r in ok)) if ok else 0.0
    busy = in_flight_seconds(ok, engines)
    total_busy = sum(busy)
    pred = [r for r in ok if r.get("predicted") is not None and r.get("cached") is not None]
    err = [abs(r["predicted"] - r["cached"]) for r in pred]
    over = [r for r in pred if r["predicted"] > r["cached"]]
    counts = [0] * engines
    for r in ok:
        if 0 <= r.get("engine", -1) < engines:
            counts[r["engine"]] += 1
    return {
        "policy": _policy(run),
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "ttft_mean": sum(ttft) / len(ttft) if ttft else float("nan"),
        "e2e_p50": percentile(e2e, 50),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "prompt_tps": prompt / span if span > 0 else 0.0,
        "max_share": max(busy) / total_busy if total_busy > 0 else float("nan"),
        "request_share": [c / len(ok) if ok else 0.0 for c in counts],
        "pred_mae": sum(err) / len(err) if err else None,
        "pred_mae_pct": (sum(err) / sum(r["prompt_tokens"] or 1 for r in pred)) if pred else None,
        "pred_over": len(over) / len(pred) if pred else None,
        "cpu": _cpu(run),
    }


def load_share_series(
    recs: Sequence[dict[str, Any]], engines: int, bins: int = 40
) -> tuple[list[float], list[list[float]]]:
    """(bin centres in s, per engine its share of in-flight request-time in each bin)."""
    ok = [r for r in recs if 0 <= r.get("engine", -1) < engines and r.get("t_end")]
    if not ok:
        return [], [[] for _ in range(engines)]
    t_min = min(r["t_send"] for r in ok)
    t_max = max(r["t_end"] for r in ok)
    width = (t_max - t_min) / bins or 1.0
    acc = [[0.0] * bins for _ in range(engines)]
    for r in ok:
        a, b = r["t_send"], r["t_end"]
        i0 = int((a - t_min) / width)
        i1 = min(bins - 1, int((b - t_min) / width))
        for i in range(max(0, i0), i1 + 1):
            lo = t_min + i * width
            hi = lo + width
            acc[r["engine"]][i] += max(0.0, min(b, hi) - max(a, lo))
    shares = [[0.0] * bins for _ in range(engines)]
    for i in range(bins):
        tot = sum(acc[e][i] for e in range(engines))
        for e in range(engines):
            shares[e][i] = acc[e][i] / tot if tot > 0 else 0.0
    centres = [t_min + (i + 0.5) * width - t_min for i in range(bins)]
    return centres, shares


# ----------------------------------------------------------------------------------------
# Markdown


def _f(x: Any, fmt: str = "{:.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _results_runs(res: dict[str, Any]) -> list[Any]:
    return list(res["runs"])


def _engines(args: Any) -> int:
    return args["engines"] if isinstance(args, dict) else args.engines


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def workload_table(res: dict[str, Any], engines: int) -> tuple[str, list[dict[str, Any]]]:
    rows = [summarize(run, engines) for run in _results_runs(res)]
    head = (
        "| policy | ok | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | "
        "prompt tok/s | largest in-flight share | pred. error (tokens, % of prompt) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for s in rows:
        pe = (
            f"{s['pred_mae']:.0f} ({100 * s['pred_mae_pct']:.1f} %)"
            if s["pred_mae"] is not None
            else "-"
        )
        lines.append(
            f"| {POLICY_LABEL.get(s['policy'], s['policy'])} | {s['ok']}/{s['requests']} | "
            f"{100 * s['hit_rate']:.1f} % | {_f(s['ttft_p50'])} | {_f(s['ttft_p90'])} | "
            f"{_f(s['ttft_p99'])} | {s['throughput_rps']:.1f} | {s['prompt_tps']:.0f} | "
            f"{_f(100 * s['max_share'], '{:.0f} %')} | {pe} |"
        )
    return head + "\n".join(lines) + "\n", rows


def _verdict(rows: list[dict[str, Any]]) -> str:
    by = {r["policy"]: r for r in rows}
    p = by.get("prefix")
    if p is None:
        return ""
    parts = []
    for base in ("round_robin", "least_loaded"):
        b = by.get(base)
        if b:
            parts.append(
                f"hit rate {100 * p['hit_rate']:.1f} % vs {100 * b['hit_rate']:.1f} % for "
                f"{POLICY_LABEL[base]}, TTFT p50 {_f(p['ttft_p50'])} vs {_f(b['ttft_p50'])} ms"
            )
    o = by.get("oracle")
    if o:
        gap = 100 * (o["hit_rate"] - p["hit_rate"])
        parts.append(
            f"upper bound {100 * o['hit_rate']:.1f} % hit rate ("
            + (
                f"router {gap:.1f} points below"
                if gap > 0.05
                else f"router {-gap:.1f} points above: same cost formula, different load "
                "and eviction history"
                if gap < -0.05
                else "router equal"
            )
            + f"), TTFT p50 {_f(o['ttft_p50'])} ms vs {_f(p['ttft_p50'])} ms for the router"
        )
    return "Router (prefix): " + "; ".join(parts) + "." if parts else ""


def _cpu_line(rows: list[dict[str, Any]]) -> str:
    bits = []
    for s in rows:
        c = s["cpu"]
        if not c:
            continue
        busy = c.get("machine_busy")
        cs = c.get("cpu_s", {})
        own = ", ".join(f"{k} {v:.1f}" for k, v in cs.items())
        dec = c.get("router_decision_ms") or {}
        if dec:
            stages = ("tokenize", "hash", "match", "choose", "total")
            own += "; router decision mean ms: " + ", ".join(
                f"{k} {dec[k]:.2f}" for k in stages if k in dec
            )
        bits.append(
            f"{POLICY_LABEL.get(s['policy'], s['policy'])}: machine "
            f"{_f(None if busy is None else 100 * busy, '{:.0f} %')} busy over "
            f"{c.get('cpus')} CPUs, load avg {_f(c.get('loadavg_1m'), '{:.1f}')}; "
            f"CPU s used: {own}"
        )
    return "\n".join(f"- {b}" for b in bits)


def fleet_markdown(
    results: list[dict[str, Any]],
    args: Any,
    elapsed_s: float,
    img_rel: str | None = None,
    command: str | None = None,
) -> str:
    engines = _engines(args)
    cmd = command or "python -m bench.fleet " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    mode = (
        f"closed loop, {_arg(args, 'closed_loop')} at a time"
        if _arg(args, "closed_loop")
        else "open loop, Poisson arrivals"
    )
    out = [
        f"Command: `{cmd}` ({elapsed_s:.0f} s in all).\n",
        f"Fleet: {engines} engine shims, {_arg(args, 'gpu_blocks')} KV blocks of 16 tokens "
        f"each, GPU cost model at time scale {_arg(args, 'time_scale')}, "
        f"{_arg(args, 'max_tokens')} output tokens per request; {mode}.\n",
    ]
    for res in results:
        table, rows = workload_table(res, engines)
        rate = res.get("rate") or 0
        mean_prompt = rows[0]["prompt_tokens"] / rows[0]["ok"] if rows and rows[0]["ok"] else 0
        out.append(
            f"\n### {res['workload']}\n\n{res['requests']} requests"
            + (f" in {res['sessions']} sessions" if res.get("sessions") else "")
            + f", mean prompt {mean_prompt:.0f} tokens"
            + (f", {rate:.1f} req/s offered" if not res.get("closed_loop") else "")
            + ".\n\n"
            + table
        )
        v = _verdict(rows)
        if v:
            out.append("\n" + v + "\n")
        cpu = _cpu_line(rows)
        if cpu:
            out.append("\nCPU during each run:\n" + cpu + "\n")
        if img_rel:
            w = res["workload"]
            out.append(
                f"\n![TTFT CDF, {w}]({img_rel}/fleet-{w}-ttft.png) "
                f"![hit rate, {w}]({img_rel}/fleet-{w}-hit.png)\n\n"
                f"![load share per engine over time, {w}]({img_rel}/fleet-{w}-load.png)\n"
            )
    return "".join(out)


def write_section(path: Path, name: str, text: str, title: str | None = None) -> None:
    """Replace the ``name`` section of the report (or append it) and keep the rest."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        pre, rest = old.split(begin, 1)
        _, post = rest.split(end, 1)
        new = pre + block + post
    else:
        new = old.rstrip() + ("\n\n" if old else "") + (f"## {title}\n\n" if title else "") + block
        new += "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


# ----------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_workload(res: dict[str, Any], engines: int, img_dir: Path) -> list[Path]:
    plt = _plt()
    img_dir.mkdir(parents=True, exist_ok=True)
    w = res["workload"]
    runs = _results_runs(res)
    paths = []

    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=80)
    for run in runs:
        ttft = sorted(
            r["ttft"] * 1000 for r in _records(run) if r.get("ttft") is not None and not r["error"]
        )
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax.step(ttft, ys, where="post", label=POLICY_LABEL.get(_policy(run), _policy(run)))
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks([t for t in (5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)])
    ax.set_xlabel("time to first token, ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {w}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(img_dir / f"fleet-{w}-ttft.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.0), dpi=80)
    rows = [summarize(run, engines) for run in runs]
    names = [POLICY_LABEL.get(s["policy"], s["policy"]) for s in rows]
    vals = [100 * s["hit_rate"] for s in rows]
    bars = ax.barh(names, vals, color="#4c72b0")
    for b, v in zip(bars, vals, strict=True):
        ax.text(v + 0.5, b.get_y() + b.get_height() / 2, f"{v:.1f} %", va="center", fontsize=8)
    ax.set_xlim(0, 105)
    ax.invert_yaxis()
    ax.set_xlabel("engine-reported prefix hit rate, % of prompt tokens")
    ax.set_title(f"Hit rate: {w}")
    fig.tight_layout()
    paths.append(img_dir / f"fleet-{w}-hit.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(5.5, 1.3 * n + 0.6), dpi=80, sharex=True)
    axes = [axes] if n == 1 else list(axes)
    for ax, run in zip(axes, runs, strict=True):
        xs, shares = load_share_series(_records(run), engines)
        if xs:
            ax.stackplot(xs, *shares, labels=[f"engine {e}" for e in range(engines)])
        ax.axhline(1 / engines, color="k", lw=0.6, ls=":")
        ax.set_ylim(0, 1)
        ax.set_yticks([0, 0.5, 1])
        ax.set_ylabel(POLICY_LABEL.get(_policy(run), _policy(run)), fontsize=7)
    axes[0].set_title(f"Share of in-flight requests per engine over time: {w}", fontsize=9)
    axes[-1].set_xlabel("seconds into the run")
    axes[0].legend(fontsize=6, ncol=min(engines, 8), loc="upper right")
    fig.tight_layout()
    paths.append(img_dir / f"fleet-{w}-load.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def write_fleet_report(
    path: Path,
    results: list[dict[str, Any]],
    args: Any,
    img_dir: Path,
    elapsed_s: float,
    command: str | None = None,
) -> None:
    engines = _engines(args)
    for res in results:
        plot_workload(res, engines, img_dir)
    try:
        rel = str(img_dir.resolve().relative_to(path.parent.resolve()))
    except ValueError:
        rel = str(img_dir)
    text = fleet_markdown(results, args, elapsed_s, img_rel=rel, command=command)
    write_section(path, "fleet", text, title="Fleet benchmark (generated)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="/tmp/bench-fleet/results.json")
    ap.add_argument("--report", required=True)
    ap.add_argument("--img-dir", default=None)
    ap.add_argument("--command", default=None, help="the command line to quote in the report")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.results).read_text())
    args = doc["args"]
    img = Path(a.img_dir) if a.img_dir else Path(a.report).parent / "img"
    write_fleet_report(
        Path(a.report),
        doc["workloads"],
        args,
        img,
        doc.get("elapsed_s", 0.0),
        command=a.command or doc.get("command"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

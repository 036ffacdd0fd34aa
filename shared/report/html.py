"""The report as one HTML page with two PNG plots beside it (matplotlib, Agg backend).

`write_html(report, out)` writes `out` and, next to it, `<stem>-hit-rate.png`
(served hit rate per window against Belady, the self-built baseline's LRU L1
and an infinite cache) and
`<stem>-cost.png` (USD per 1M tokens for each option). Returns every path
written. Needs matplotlib (the `bench` or `test` extra).
"""

from __future__ import annotations

from html import escape
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rate(report: dict, out: Path) -> Path:
    plt = _pyplot()
    curve = report["hit_rate_over_time"]
    xs = [w["start_s"] / 60 for w in curve["windows"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    for key, style, label in (("served", "o-", "served (any tier)"), ("served_device", "s-", "served (device pools)"),
                              ("belady", "k--", f"Belady, pooled L1 {curve['capacity_blocks']:,} blocks"),
                              ("lru_l1", "r-.", "self-built engine, LRU L1 (same capacity)"),
                              ("infinite", "k:", "infinite cache")):
        ax.plot(xs, [100 * w[key] for w in curve["windows"]], style, label=label, markersize=3, linewidth=1.5)
    ax.set_xlabel(f"minutes since the first request ({curve['window_s']:.0f} s windows)")
    ax.set_ylabel("prefix hit rate (% of prompt blocks)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("hit rate over time vs Belady")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_costs(report: dict, out: Path) -> Path:
    plt = _pyplot()
    costs = report["cost_per_1m_tokens_usd"]
    names = list(costs)
    colors = ["#2b6cb0" if n == report["recommendation"] or (report["recommendation"] == "hosted" and
              n == report["hosted"]["cheapest"]) else "#a0aec0" for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    bars = ax.bar(names, [costs[n] for n in names], color=colors)
    ax.bar_label(bars, labels=[f"${costs[n]:.3f}" for n in names], fontsize=8)
    ax.set_ylabel("USD per 1M tokens (in + out)")
    ax.set_title(f"cost per 1M tokens (prices as of {report['prices']['as_of']})")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _rows(pairs) -> str:
    return "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in pairs)


def write_html(report: dict, out: Path) -> list[Path]:
    """Write the page and its two PNGs; returns [page, hit-rate png, cost png]."""
    out.parent.mkdir(parents=True, exist_ok=True)
    hit_png = plot_hit_rate(report, out.with_name(f"{out.stem}-hit-rate.png"))
    cost_png = plot_costs(report, out.with_name(f"{out.stem}-cost.png"))
    m = report["measured"]
    measured = _rows([
        ("requests", m["requests"]), ("tokens in / out", f"{m['tokens_in']:,} / {m['tokens_out']:,}"),
        ("cached tokens", f"{m['cached_tokens']:,} ({m['hit_rate']:.1%})"),
        ("cache writes by TTL (s)", m["cache_write_tokens"] or "none"),
        ("hit rate per tier", ", ".join(f"{t} {r:.1%}" for t, r in m["tier_hit_rates"].items())),
        ("sessions / turns (mean, p50, p90)",
         f"{m['sessions']} / {m['turns']['mean']:.2f}, {m['turns']['p50']:.0f}, {m['turns']['p90']:.0f}"),
        ("QPS mean / peak (per minute), peak/mean",
         f"{m['load']['mean_qps']:.3f} / {m['load']['peak_qps']:.3f}, {m['load']['peak_to_mean']:.2f}"),
        ("requests/day (extrapolated)", f"{m['load']['requests_per_day']:,.0f}"),
        ("workers / tenants", f"{m['workers']} / {m['tenants']}"),
    ])
    costs = _rows((k, f"${v:.4f}") for k, v in report["cost_per_1m_tokens_usd"].items())
    built = report["self_built"]
    saved = _rows((f"{s['source']}: more tokens cached / prefill GPU-s / USD saved",
                   f"{s['cached_tokens']:,} ({s['hit_rate']:.1%}) / {s['prefill_gpu_s']:,.3f} / ${s['usd']:.6f} "
                   f"(${s['per_1m_tokens_usd']:.4f} per 1M tokens)") for s in built["savings"])
    reasons = "".join(f"<li>{escape(r)}</li>" for r in report["reasons"])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvmesh cost report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}th{{text-align:left;padding-right:1em}}</style>
</head><body>
<h1>kvmesh cost report</h1>
<p>Prices: {escape(report['prices']['file'])} (as of {escape(report['prices']['as_of'])}).</p>
<h2>Recommendation: {escape(report['recommendation'])}</h2><ul>{reasons}</ul>
<h2>Measured</h2><table>{measured}</table>
<h2>Cost per 1M tokens</h2><table>{costs}</table>
<p>{escape(report['hosted']['assumption'])}. Self-built: a stated model, not measured
({escape(report['self_built']['model']['prefill'])}; decode {report['self_built']['model']['decode_tokens_per_s']:,.0f}
tokens/s per GPU; {escape(report['self_built']['model']['provisioning'])}).</p>
<img src="{escape(cost_png.name)}" alt="cost per 1M tokens for each option">
<h2>Where the GPU savings come from</h2>
<p>Against no cache (prefill {built['no_cache']['prefill_gpu_s']:,.3f} GPU-s, ${built['no_cache']['total_usd']:.6f}).
The self-built baseline is {escape(built['baseline']['what'])}; kvmesh_on_top is kvmesh's hits minus the baseline's.
kvmesh's hits include {built['baseline']['answer_block_tokens']:,} tokens of blocks no earlier prompt held (written by a
previous answer), which an engine that caches its generated blocks may hit too.</p>
<table>{saved}</table>
<h2>Hit rate over time</h2>
<img src="{escape(hit_png.name)}" alt="hit rate over time against Belady">
</body></html>
"""
    out.write_text(page)
    return [out, hit_png, cost_png]

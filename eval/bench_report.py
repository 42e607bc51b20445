"""`draftsmith bench`'s report: report.json (every number), report.md, a self-contained report.html
(its plots embedded), and the plots as PNG files beside them."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from draftsmith.data.health import eval_line
from draftsmith.heads.infra.files import write_atomic

from .report import by_context_line

PLOTS = ("speedup.png", "latency.png", "acceptance.png", "acceptance-by-context.png", "speedup-by-concurrency.png")
COLUMNS = ["category", "requests", "speedup (interval)", "verdict", "TTFT p50 before → after",
           "total p50 / p90 before → after (s)", "tokens/s before → after", "tau", "identical text", "cost/request"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def table_rows(groups: dict) -> list[list[str]]:
    rows = []
    for category, g in groups.items():
        p, s = g["plain"], g["speculative"]
        low, high = g["speedup_interval"]
        identical = g.get("identical_text")
        cost = (f"{p['cost_per_request']:.6f} → {s['cost_per_request']:.6f}" if "cost_per_request" in p else "")
        rows.append([
            f"**{category}**" if category == "all" else category, str(g["requests"]),
            f"{g['speedup']:.2f}x ({low:.2f}-{high:.2f})", g["verdict"].split(":")[0],
            f"{_ms(p['ttft_p50_s'])} → {_ms(s['ttft_p50_s'])}",
            f"{p['total_p50_s']:.2f} / {p['total_p90_s']:.2f} → {s['total_p50_s']:.2f} / {s['total_p90_s']:.2f}",
            f"{p['tokens_per_s_per_request']:.1f} → {s['tokens_per_s_per_request']:.1f}"
            + (f" (batch {p['tokens_per_s_batch']:.1f} → {s['tokens_per_s_batch']:.1f})" if "tokens_per_s_batch" in p
               and "tokens_per_s_batch" in s else ""),
            "" if g["tau"] is None else f"{g['tau']:.2f}", "" if identical is None else f"{identical:.0%}", cost,
        ])
    return rows


def level_name(level: dict) -> str:
    return f"temperature {level['temperature']:g}, concurrency {level['concurrency']}"


def header_lines(report: dict) -> list[str]:
    settings, traffic, baseline = report["settings"], report["traffic"], report.get("baseline", "plain")
    sampled = ", ".join(f"{c} {n}/{traffic['available'][c]}" for c, n in traffic["sampled"].items())
    lines = [
        f"{report['kind']} drafter on {report['target']} ({report['dtype']}, {report['device']}), proposal "
        f"{report['proposal']}; engine {report['engine']}",
        f"traffic {traffic['source']}: requests per category sampled/available: {sampled}"
        + (f"; lines without a prompt skipped: {traffic['skipped_without_prompt']}"
           if traffic["skipped_without_prompt"] else ""),
        (f"{settings['repeats']} repeats, with and without the drafter interleaved" if baseline == "plain" else
         f"{settings['repeats']} repeats, the drafter against {baseline} interleaved (before: the baseline)")
        + f"; up to {settings['max_new_tokens']} new tokens; speedup = {'plain' if baseline == 'plain' else 'baseline'} "
        f"s per token / speculative s per token, interval: {report['interval']}; "
        f"{report['seconds'] / 60:.1f} min",
    ]
    if report.get("serving_config"):
        chosen = report["serving_config"]
        lines.append(f"measured vLLM speculative_config: {json.dumps(chosen['speculative_config'])} ({chosen['why']})")
    if not report["complete"]:
        lines.insert(0, "INCOMPLETE: interrupted; this report holds what was measured before the interruption")
    return lines


def markdown(report: dict, plots: list[str] = ()) -> str:
    lines = [f"# draftsmith bench: {report['checkpoint']}", ""] + [f"- {line}" for line in header_lines(report)]
    if report.get("target_health"):
        lines += [f"- {eval_line(report['target_health'])}"]
    lines += ["", f"**Recommendation:** {report['recommendation']}", ""]
    for level in report["results"]:
        groups = level["groups"]
        lines += [f"## {level_name(level)}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in table_rows(groups)]
        if "all" in groups:
            lines += ["", "per-position acceptance (all): "
                      + " ".join(f"{a:.2f}" for a in groups["all"]["per_position_acceptance"])]
            if groups["all"].get("acceptance_by_context"):
                lines += ["", "by context length (all): " + by_context_line(groups["all"]["acceptance_by_context"])]
        lines.append("")
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def html_page(report: dict, images: dict[str, bytes]) -> str:
    esc = html.escape
    parts = ["<!doctype html><meta charset='utf-8'><title>draftsmith bench</title>"
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style>",
             f"<h1>draftsmith bench: {esc(report['checkpoint'])}</h1><ul>"]
    parts += [f"<li>{esc(line)}</li>" for line in header_lines(report)]
    parts.append(f"</ul><p><b>Recommendation:</b> {esc(report['recommendation'])}</p>")
    for level in report["results"]:
        groups = level["groups"]
        parts.append(f"<h2>{esc(level_name(level))}</h2><table><tr>"
                     + "".join(f"<th>{esc(c)}</th>" for c in COLUMNS) + "</tr>")
        for row in table_rows(groups):
            parts.append("<tr>" + "".join(f"<td>{esc(cell.strip('*'))}</td>" for cell in row) + "</tr>")
        parts.append("</table>")
    for name, data in images.items():
        parts.append(f"<p><img alt='{esc(name)}' src='data:image/png;base64,{base64.b64encode(data).decode()}'></p>")
    return "\n".join(parts)


def plot(report: dict, out_dir: Path) -> list[str]:
    """Speedup by category (with intervals), TTFT and total time before and after, acceptance per
    position, and speedup against concurrency when several load levels were measured."""
    import matplotlib  # heavy: only when a report draws its plots
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: only when a report draws its plots

    levels = [level for level in report["results"] if level["groups"]]
    if not levels:
        return []
    figures = {"speedup.png": speedup_figure(plt, levels), "latency.png": latency_figure(plt, levels[0]),
               "acceptance.png": acceptance_figure(plt, levels)}
    if any(level["groups"].get("all", {}).get("acceptance_by_context") for level in levels):
        figures["acceptance-by-context.png"] = context_figure(plt, levels)
    if len({level["concurrency"] for level in levels}) > 1:
        figures["speedup-by-concurrency.png"] = concurrency_figure(plt, levels)
    for name, fig in figures.items():
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
    return [name for name in PLOTS if name in figures]


def speedup_figure(plt, levels: list[dict]):
    names = list(levels[0]["groups"])
    fig, ax = plt.subplots(figsize=(max(8, len(names) * len(levels) * 0.35), 4))
    width = 0.8 / len(levels)
    for k, level in enumerate(levels):
        groups = level["groups"]
        speed = [groups[c]["speedup"] if c in groups else 0.0 for c in names]
        err = [[max(0.0, s - groups[c]["speedup_interval"][0]) if c in groups else 0.0 for c, s in zip(names, speed)],
               [max(0.0, groups[c]["speedup_interval"][1] - s) if c in groups else 0.0 for c, s in zip(names, speed)]]
        ax.bar([i + k * width for i in range(len(names))], speed, width, yerr=err, capsize=3, label=level_name(level))
    ax.set_xticks([i + width * (len(levels) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup (before / after s per token)")
    ax.legend(fontsize=7)
    return fig


def latency_figure(plt, level: dict):
    groups, names = level["groups"], list(level["groups"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_p50_s", "time to first token p50 (s)"),
                           (axes[1], "total_p50_s", "total time p50 (s)")):
        for k, mode in enumerate(("plain", "speculative")):
            ax.bar([i + k * 0.4 for i in range(len(names))], [groups[c][mode][key] for c in names], 0.4,
                   label="before" if mode == "plain" else "after (the drafter)")
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=30, ha="right")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(level_name(level))
    return fig


def acceptance_figure(plt, levels: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = ([(c, g["per_position_acceptance"]) for c, g in levels[0]["groups"].items()] if len(levels) == 1 else
              [(level_name(level), level["groups"]["all"]["per_position_acceptance"]) for level in levels])
    for label, rates in curves:
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label, linewidth=2.5 if label == "all" else 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (fraction of steps)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    return fig


def context_figure(plt, levels: list[dict]):
    """Tau by the context length at each verification step (docs/metrics.md), one line per load level."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for level in levels:
        buckets = level["groups"].get("all", {}).get("acceptance_by_context") or []
        if buckets:
            ax.plot([b["context"] for b in buckets], [b["tau"] for b in buckets], marker="o", label=level_name(level))
    ax.set_xlabel("context length at the step (tokens)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.legend(fontsize=7)
    return fig


def concurrency_figure(plt, levels: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 4))
    for temperature in dict.fromkeys(level["temperature"] for level in levels):
        row = [level for level in levels if level["temperature"] == temperature]
        conc = [level["concurrency"] for level in row]
        speed = [level["groups"]["all"]["speedup"] for level in row]
        low = [s - level["groups"]["all"]["speedup_interval"][0] for s, level in zip(speed, row)]
        high = [level["groups"]["all"]["speedup_interval"][1] - s for s, level in zip(speed, row)]
        ax.errorbar(conc, speed, yerr=[low, high], marker="o", capsize=3, label=f"temperature {temperature:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("speedup, all categories")
    ax.legend()
    return fig


def write_reports(report: dict, out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "report.json", json.dumps(report, indent=1))
    plots = plot(report, out_dir)
    write_atomic(out_dir / "report.md", markdown(report, plots))
    write_atomic(out_dir / "report.html", html_page(report, {n: (out_dir / n).read_bytes() for n in plots}))

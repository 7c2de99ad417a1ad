"""``OUT/report/index.html``: one self-contained page (plots inlined as data URIs) with the
run's numbers, the plots, the quarantine reasons with a few example records each, and
links to the JSON reports beside it."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from typing import Any

PAGE_NAME = "index.html"
EXAMPLE_CHARS = 400  # of a quarantined record's raw text
CAPTIONS = {
    "lengths.png": "Packed sample lengths by modality; the dashed line is the budget. The note says "
    "what did not fit as it was: dropped, truncated or split at tokenize, skipped by pack.",
    "bin_tokens.png": "Tokens per bin by modality, fullest bin first: how full the bins are and "
    "what fills them.",
    "bin_supervised.png": "Tokens with a label per bin: the learning signal each step gets.",
    "bin_attention.png": "Attention cost per bin (sum of squared sample lengths), most expensive first.",
    "bin_patches.png": "Vision patches per bin (the vision tower's work), most first.",
    "bin_cost.png": "Per-bin cost of both phases, and the slowest of 8 ranks per step in today's order "
    "and in the balanced plan.",
}
STYLE = """body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left;vertical-align:top}td.n{text-align:right}figure{display:inline-block;margin:0 1em 1.5em 0;
width:520px}figure img{width:100%}figcaption{font-size:13px;color:#555}pre{white-space:pre-wrap;
font-size:12px;margin:0;max-width:600px}h2{margin-top:1.8em}"""


def render(
    pack: Mapping[str, Any],
    stages: Mapping[str, Mapping[str, Any]],
    plots: Mapping[str, bytes],
    examples: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    links: Sequence[str],
) -> str:
    """The page. ``stages``: the normalize/tokenize summaries that exist; ``examples``: per
    quarantine table, per reason, a few rows; ``links``: files beside the page."""
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>mmpack report {_e(pack['run_id'])}</title><style>{STYLE}</style></head><body>",
        f"<h1>mmpack packing report</h1><p>run <code>{_e(pack['run_id'])}</code>, "
        f"manifest <code>{_e(pack['manifest'])}</code></p>",
        "<h2>Numbers</h2>",
        _table(_pack_rows(pack)),
        *_stage_sections(stages),
        "<h2>Plots</h2>",
        *[_figure(name, png) for name, png in plots.items()],
        "<h2>Quarantine</h2>",
        *_quarantine_sections(stages, examples),
        "<h2>Files</h2><ul>",
        *[f'<li><a href="{_e(link)}">{_e(link)}</a></li>' for link in links],
        "</ul></body></html>",
    ]
    return "\n".join(parts)


def _pack_rows(s: Mapping[str, Any]) -> list[tuple[str, str]]:
    if not s.get("bins"):
        return [("budget", f"{s['budget']:,} tokens"), ("bins", "0 (no tokenized rows)")]
    share, cost = s["token_share"], s["attention_cost"]
    return [
        ("budget", f"{s['budget']:,} tokens per bin"),
        ("samples → bins", f"{s['samples']:,} → {s['bins']:,} (lower bound {s['lower_bound_bins']:,})"),
        ("fill", f"{100 * s['fill']:.2f} %"),
        ("tokens", f"{s['tokens']:,}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in share.items())),
        ("supervised", f"{100 * s['supervised_share']:.1f} % of tokens"),
        ("samples per bin", f"mean {s['samples_per_bin']['mean']}, max {s['samples_per_bin']['max']:.0f}"),
        ("attention cost spread", f"max/mean {cost['max_over_mean']}, cv {cost['cv']}"),
        ("skipped by pack", f"{s['skipped']:,}"),
        ("shards", f"{s['shards']} file(s), {s['bytes'] / 2**20:,.1f} MiB"),
        ("bytes per token", f"{s['bytes_per_token']} (media: {s['media']})"),
    ]


def _stage_sections(stages: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    if "normalize" in stages:
        t = stages["normalize"]["totals"]
        out += ["<h2>Normalize</h2>", _table([(k, f"{v:,}") for k, v in t.items()])]
    if "tokenize" in stages:
        s = stages["tokenize"]
        rows = [(k.replace("_", " "), f"{v:,}") for k, v in s["counts"].items()]
        rows.append(("max_tokens, over_length", f"{s['max_tokens']:,}, {s['over_length']}"))
        out += ["<h2>Tokenize</h2>", _table(rows)]
    return out


def _quarantine_sections(
    stages: Mapping[str, Mapping[str, Any]], examples: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]
) -> list[str]:
    out = []
    for stage, table in (("normalize", "quarantine"), ("tokenize", "tokenize_quarantine")):
        reasons = stages.get(stage, {}).get("reasons", {})
        if not reasons:
            continue
        out.append(f"<h3>{stage}: {sum(reasons.values()):,} rows in tables/{table}</h3>")
        out.append("<table><tr><th>reason</th><th>rows</th><th>examples</th></tr>")
        for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
            shown = "".join(_example(row) for row in examples.get(table, {}).get(reason, []))
            out.append(f"<tr><td>{_e(reason)}</td><td class=n>{count:,}</td><td>{shown}</td></tr>")
        out.append("</table>")
    return out or ["<p>nothing quarantined</p>"]


def _example(row: Mapping[str, Any]) -> str:
    where = row.get("sample_id") or f"{row.get('source_file')}:{row.get('source_position')}"
    text = row.get("raw") or ""
    snippet = text[:EXAMPLE_CHARS] + ("…" if len(text) > EXAMPLE_CHARS else "")
    detail = f" — {_e(row['detail'])}" if row.get("detail") else ""
    return f"<p><code>{_e(where)}</code>{detail}</p>" + (f"<pre>{_e(snippet)}</pre>" if snippet else "")


def _figure(name: str, png: bytes) -> str:
    data = base64.b64encode(png).decode()
    caption = CAPTIONS.get(name, "")
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{_e(name)}">'
        f'<figcaption><a href="{_e(name)}">{_e(name)}</a>: {_e(caption)}</figcaption></figure>'
    )


def _table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _e(value: Any) -> str:
    return html.escape(str(value))

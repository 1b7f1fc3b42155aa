"""`tessera plan`'s report as text: rich tables on a terminal, aligned plain text otherwise (`render`), from the plan
`tessera.run.plan.build_plan` returns."""

from __future__ import annotations

from tessera.run.plan import GIB


def _size(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2.0 ** 20), ("KiB", 1024.0)):
        if abs(b) >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def _count(n: float) -> str:
    return f"{n:,.0f}" if n < 1e3 else f"{n:,.0f} ({n / 1e9:.2f} B)" if n >= 1e8 else f"{n:,.0f}"


def _flop(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t:,.2f} s" if t >= 1 else f"{t * 1e3:,.2f} ms" if t >= 1e-3 else f"{t * 1e6:,.2f} µs"


def sections(plan: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as titled (label, value) rows, shared by the table and the plain-text form."""
    p, f, m, d = plan["params"], plan["flops"], plan["memory_per_device"], plan["device"]
    mesh = " × ".join(f"{a}={n}" for a, n in plan["mesh"].items() if n > 1) or "no axis > 1"
    shapes = plan["shapes"]
    if plan.get("mesh_choice"):
        mesh = f"auto: {mesh}; {plan['mesh_choice']['reason']}"
    if plan.get("pipeline"):
        pipe = plan["pipeline"]
        mesh += (f"; deterministic pp splits the layers over {pipe['stages']} stages" if pipe["split_compute"] else
                 f"; deterministic pp acts as a data axis ({pipe['why_not']})")
    if plan.get("tensor"):
        tp = plan["tensor"]
        mesh += (f"; deterministic tp splits the attention, MLP and expert compute over tp={tp['tp']}"
                 if tp["split_compute"] else f"; deterministic tp acts as a data axis ({tp['why_not']})")
    if plan.get("experts"):
        ep = plan["experts"]
        mesh += (f"; deterministic ep splits the experts' compute over ep={ep['ep']}"
                 if ep["split_compute"] else f"; deterministic ep acts as a data axis ({ep['why_not']})")
    head = [("model", f"{plan['model']} ({plan['spec']}), task {plan['task']}"),
            ("mesh", f"{mesh} ({plan['devices']} device{'s' if plan['devices'] != 1 else ''})"),
            ("shapes", f"batch {shapes['batch']}, seq {shapes['seq']}, microbatches {shapes['microbatches']}, "
                       f"remat {shapes['remat']}" if "inputs" not in shapes else
             ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in shapes["inputs"].items())
             + f"; remat {shapes['remat']}")]
    per = shapes.get("per", "token")
    params = [("total", _count(p["total"])), ("active per token", _count(p["active"])),
              ("bytes (storage types)", _size(p["bytes"]))]
    params += [(f"  in {dt}", _size(b)) for dt, b in p["bytes_by_dtype"].items()]
    memory = [(k.replace("_", " "), _size(v)) for k, v in m.items() if k != "total"]
    memory += [("total", _size(m["total"])), (f"{d['key']}: {d['name']}", _size(d["memory_bytes"])),
               ("fits", f"{'yes' if d['fits'] else 'NO'} (margin {_size(d['margin_bytes'])})")]
    flops = [(f"forward per {per}", _flop(f["forward_per_token"])),
             (f"train step per {per}", _flop(f["train_step_per_token"])),
             ("  with remat recompute", _flop(f["train_step_hardware_per_token"])),
             (f"{d['step']} time (at peak)", _time(d["step_time_s"])),
             ("MFU ceiling", "-" if d["mfu_ceiling"] is None else f"{d['mfu_ceiling']:.1%}")]
    comms = [(f"{c['axis']} {c['kind']}: {c['what']}", _size(c["bytes_per_step"])) for c in plan["collectives"]]
    c = plan["compile"]
    comp = [("status", c["status"] + (f" in {c['seconds']:.1f} s" if "seconds" in c else ""))]
    if c.get("status") == "ok":
        from tessera.run.plan_compile import COMPILER_FIGURES

        figures = c.get("compiler_bytes") or {}
        comp += [("compiler memory", _size(figures.get("total")))]
        comp += [(f"  {k}", _size(figures[k])) for k in COMPILER_FIGURES if figures.get(k)]
        comp += [("ours, same program", _size(c["ours_bytes"]))]
    comp += [("note", c["note"])] if c.get("note") else []
    step = d["step"]
    parts = [("plan", head), ("parameters", params)]
    if plan.get("numerics"):
        parts.append(("numerics (storage -> compute)", _numerics_rows(plan["numerics"])))
    return parts + [("memory per device", memory), ("FLOPs", flops),
                    (f"collectives per {step}, bytes sent per device", comms or [("none", "-")]),
                    ("ahead-of-time compile", comp)]


def _numerics_rows(n: dict) -> list[tuple[str, str]]:
    """Compute, accumulation and loss scaling, then each parameter's storage and compute type."""
    rows = [("compute / accumulate", f"{n['compute']} / {n['accumulate']}"), ("loss scaling", n["loss_scale"])]
    if n.get("fp8_products"):
        rows.append(("products with weights", f"fp8: e4m3 forward, e5m2 gradients, scaled {n['fp8_products']}"))
    if n.get("fp8_amax_history"):
        h = n["fp8_amax_history"]
        rows.append(("  amax history", f"{h['length']} steps x (input, weight, grad) per product, in the optimizer "
                                       f"state; {h['inference']} at inference"))
    for label, op in (n.get("by_op") or {}).items():  # numerics.compute's rules, per op
        rows.append((f"  op {label}", f"{'fp8 products' if op['fp8'] else n['compute'] + ' products'}  "
                                      f"(compute rule {op['rule']})"))
    for path, p in n["by_param"].items():
        rule = f"  (rule {p['rule']})" if p["rule"] else ""
        rows.append((f"  {path}", f"{p['storage']} -> {p['compute']}{rule}"))
    return rows


def render(plan: dict, stream) -> None:
    """Print the plan: rich tables on a terminal, aligned plain text otherwise."""
    parts = sections(plan)
    if stream.isatty():
        from rich.console import Console
        from rich.table import Table

        console = Console(file=stream)
        for title, rows in parts:
            table = Table(title=title, show_header=False, title_justify="left")
            table.add_column(style="bold")
            table.add_column(justify="right")
            for label, value in rows:
                table.add_row(label, value)
            console.print(table)
        return
    width = max(len(label) for _, rows in parts for label, _ in rows)
    for title, rows in parts:
        print(f"{title}:", file=stream)
        for label, value in rows:
            print(f"  {label:<{width}}  {value}", file=stream)

"""Engine-agnostic half of a conformance driver; runs inside an engine's venv (torch + safetensors + stdlib).

It never imports ``modelopt_k3`` (the venv holds the engine, not this project). Given a model an engine
built and a way to run that engine's own loading on it, it records:

* where every export tensor landed: the engine parameter whose bytes contain the tensor's bytes (after
  ``load_weights``, before post-processing), or that it landed nowhere byte for byte;
* the engine parameters ``load_weights`` never wrote (one load over a byte sentinel: an element is
  unwritten when all its bytes still hold it, or, for one-byte dtypes where the sentinel is a plausible value,
  unless an export tensor landed over it; those elements get their initial values back before
  post-processing, so the engine post-processes what it would have had);
* the small scale tensors the engine holds after ``process_weights_after_loading``, for the engine-specific
  driver to compare with the export's.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

SENTINEL = 0xA5
SCALE_NUMEL = 1 << 14  # post-load tensors at most this large are recorded (scales, alphas; not weights)


def export_tensors(export: Path) -> dict[str, torch.Tensor]:
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(export / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = f.get_tensor(key)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, by name (shared storage once)."""
    out = dict(model.named_parameters(remove_duplicate=True))
    out.update({k: v for k, v in model.named_buffers(remove_duplicate=True) if k not in out})
    return out


def non_persistent(model: torch.nn.Module) -> dict[str, str]:
    """Buffers a module computes at construction and never saves (no checkpoint has them)."""
    return {f"{m}.{b}" if m else b: "a non-persistent buffer (computed at construction, in no checkpoint)"
            for m, mod in model.named_modules() for b in getattr(mod, "_non_persistent_buffers_set", ())}


def fill(tensors: dict[str, torch.Tensor], byte: int) -> None:
    with torch.no_grad():
        for t in tensors.values():
            if t.numel() and t.is_contiguous():
                _bytes_view(t).fill_(byte)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def unwritten_mask(t: torch.Tensor, byte: int) -> torch.Tensor:
    """Per element: all of its bytes still equal ``byte``."""
    if not t.numel():
        return torch.zeros(0, dtype=torch.bool)
    raw = _bytes(t).reshape(t.numel(), t.element_size())
    return (raw == byte).all(dim=1)


def load_with_sentinel(model: torch.nn.Module, load: Callable[[], object],
                       ours: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict | None]]:
    """Run ``load`` (the engine's own weight loading) once over a byte sentinel; return, per engine
    tensor, the mask of elements it never wrote, and where each export tensor landed.

    An element is unwritten when all its bytes still hold the sentinel. For one-byte dtypes (packed
    FP4 codes, FP8) the sentinel is a plausible value, so there an element also counts as written when
    an export tensor landed over it. Unwritten elements get their initial values back before the
    engine post-processes (what it would have had without the sentinel). Loading once matters: loaders
    derive buffers from loaded weights exactly once (SGLang's K3 KDA merges), a second load would not
    redo them.
    """
    tensors = state(model)
    initial = {k: v.detach().clone() for k, v in tensors.items()}
    fill(tensors, SENTINEL)
    load()
    tensors = state(model)  # a loader may rebind a parameter
    land = landings(ours, tensors)
    masks = {k: unwritten_mask(v, SENTINEL) if v.is_contiguous() else torch.zeros(v.numel(), dtype=torch.bool)
             for k, v in tensors.items()}
    for name, where in land.items():
        if where is not None and "padded_to" in where and tensors[where["param"]].element_size() == 1:
            m = masks.get(where["param"])  # the data columns of the rows it landed in
            if m is not None:
                m.view(-1, where["padded_to"])[where["offset"] // where["padded_to"]:][:where["rows"], :where["cols"]] = False
            continue
        if where is None or "cast_to" in where or "rounded_to" in where or "prefix" in where or "padded_to" in where:
            continue
        m = masks.get(where["param"])
        if m is not None and tensors[where["param"]].element_size() == 1:
            m[where["offset"]:where["offset"] + ours[name].numel() * ours[name].element_size()] = False
    with torch.no_grad():
        for k, m in masks.items():
            t = tensors[k]
            if m.any() and k in initial and initial[k].shape == t.shape and initial[k].dtype == t.dtype:
                t.view(-1)[m] = initial[k].reshape(-1)[m]
    return masks, land


def _aligned_find(hay: bytes, needle: bytes, align: int) -> int:
    start = 0
    while True:
        i = hay.find(needle, start)
        if i < 0 or i % align == 0:
            return i
        start = i + 1


def _affinity(ours: str, engine: str) -> int:
    """How many trailing name parts the two names share (a tie-breaker among byte matches)."""
    a, b = ours.split("."), engine.split(".")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n + sum(p in b for p in a)


def landings(ours: dict[str, torch.Tensor], engine: dict[str, torch.Tensor]) -> dict[str, dict]:
    """For each export tensor: the engine tensor(s) holding its exact bytes (the best-named first)."""
    hay = {k: bytes(_bytes(v).numpy()) for k, v in engine.items() if v.numel() and v.is_contiguous()}
    out = {}
    for name, t in ours.items():
        needle = bytes(_bytes(t).numpy())
        found = []
        for k, h in hay.items():
            if len(h) < len(needle) or engine[k].element_size() != t.element_size():
                continue  # bytes of one element width inside another's are no landing
            at = _aligned_find(h, needle, t.element_size())
            if at >= 0:
                found.append((k, at // max(engine[k].element_size(), 1)))
        found.sort(key=lambda kv: -_affinity(name, kv[0]))
        if found:
            out[name] = {"param": found[0][0], "offset": found[0][1], "matches": len(found)}
        else:
            out[name] = _landed_cast(name, t, engine) or _landed_padded(name, t, engine)
    return out


def _landed_padded(name: str, t: torch.Tensor, engine: dict[str, torch.Tensor]) -> dict | None:
    """A 2-D tensor [r, c] found as r consecutive rows of an engine tensor whose last dim is wider (c_pad > c),
    byte for byte in the first c columns, the padding columns of those rows zero (``padded_to``): e.g. an
    expert's down_proj read into ``w2_weight`` with the intermediate size padded (a zero K-padding)."""
    if t.dim() != 2 or not t.numel():
        return None
    r, c = t.shape
    needle = bytes(_bytes(t).numpy())
    for k, v in sorted(engine.items(), key=lambda kv: -_affinity(name, kv[0])):
        if v.dim() < 2 or v.shape[-1] <= c or v.element_size() != t.element_size() or not v.is_contiguous():
            continue
        rows = v.detach().reshape(-1, v.shape[-1])
        hay = bytes(_bytes(rows[:, :c]).numpy())
        start = 0
        while True:
            at = hay.find(needle, start)
            if at < 0:
                break
            row_bytes = c * t.element_size()
            if at % row_bytes == 0:
                i = at // row_bytes
                if i + r <= rows.shape[0] and not _bytes(rows[i:i + r, c:]).any():
                    return {"param": k, "offset": i * v.shape[-1], "padded_to": int(v.shape[-1]), "rows": r, "cols": c}
            start = at + 1
    return None


def _landed_cast(name: str, t: torch.Tensor, engine: dict[str, torch.Tensor]) -> dict | None:
    """A tensor that is not in any parameter byte for byte, found in the parameter of the same name
    (last two name parts) in another form: the same values in another float dtype (``cast_to``, lossless),
    rounded to the engine's dtype (``rounded_to``, with the largest relative change), or its leading
    elements with the rest of the tensor zero (``prefix``: e.g. A_log [dk] read as [num_heads])."""
    if not t.dtype.is_floating_point or t.element_size() < 2:
        return None
    tail = ".".join(name.split(".")[-2:])
    for k, v in sorted(engine.items(), key=lambda kv: -_affinity(name, kv[0])):
        if not k.endswith(tail) or not v.dtype.is_floating_point:
            continue
        ours64, eng64 = t.to(torch.float64).reshape(-1), v.detach().to(torch.float64).reshape(-1)
        if v.shape == t.shape and torch.equal(eng64, ours64):
            return {"param": k, "offset": 0, "cast_to": str(v.dtype)}
        if v.shape == t.shape and torch.equal(eng64, t.to(v.dtype).to(torch.float64).reshape(-1)):
            rel_err = float(((eng64 - ours64).abs() / ours64.abs().clamp_min(1e-30)).max())
            return {"param": k, "offset": 0, "rounded_to": str(v.dtype), "max_rel": rel_err}
        n = v.numel()
        if 0 < n < t.numel() and torch.equal(eng64, ours64[:n].to(v.dtype).to(torch.float64)) \
                and not ours64[n:].any():
            return {"param": k, "offset": 0, "prefix": n, "of": t.numel()}
    return None


def post_load_scales(model: torch.nn.Module, names: Iterable[str]) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {attribute: float32 copy} for the named small tensors each module holds."""
    wanted = set(names)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for mname, module in model.named_modules():
        for attr in wanted:
            v = getattr(module, attr, None)
            if isinstance(v, torch.Tensor) and v.numel() <= SCALE_NUMEL and v.dtype.is_floating_point:
                out.setdefault(mname, {})[attr] = v.detach().to(torch.float32).cpu().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    den = b.abs().clamp_min(1e-30)
    return float(((a - b).abs() / den).max()) if a.numel() else 0.0


def error_record(stage: str, exc: BaseException) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb)
                  if "/conformance/drivers/" not in f.filename), "")
    return {"stage": stage, "type": type(exc).__name__, "message": str(exc)[:500], "where": where,
            "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:]}


def summarize(ours: dict[str, torch.Tensor], land: dict[str, dict | None], masks: dict[str, torch.Tensor],
              engine_owned: Callable[[str], str | None] = lambda name: None,
              by_design: dict[str, str] | None = None) -> dict:
    """Counts and lists. ``engine_owned(param)`` names why a never-written parameter is the engine's own
    (no checkpoint has it: an internal default, a buffer computed at construction); those are listed
    apart and do not make the load different. ``by_design``: export tensors found in no parameter byte for
    byte that the engine's class skips or transforms on purpose, each with why (``by_design_of`` a driver's
    ``by_design`` hook, which verifies what it can); listed apart, not as not landed."""
    by_design = {k: v for k, v in (by_design or {}).items() if land.get(k) is None}
    not_landed = sorted(k for k, v in land.items() if v is None and k not in by_design)
    cast = sorted(k for k, v in land.items() if v is not None and ("cast_to" in v or "prefix" in v or "padded_to" in v))
    rounded = {k: v for k, v in land.items() if v is not None and "rounded_to" in v}
    unwritten, owned = {}, {}
    for k, m in masks.items():
        if m.numel() and m.any():
            why = engine_owned(k) or ("an engine-internal name (leading underscore)"
                                      if k.rpartition(".")[2].startswith("_") else None)
            entry = {"elements": int(m.sum()), "of": int(m.numel())}
            (owned.__setitem__(k, {**entry, "why": why}) if why else unwritten.__setitem__(k, entry))
    return {
        "tensors": len(ours),
        "landed_byte_equal": len(ours) - len(not_landed) - len(by_design) - len(cast) - len(rounded),
        "landed_lossless_other_form": cast,
        "landed_rounded": {k: {"to": v["rounded_to"], "max_rel": v["max_rel"]} for k, v in rounded.items()},
        "not_landed": not_landed,
        "not_landed_by_design": dict(sorted(by_design.items())),
        "landed": {k: v for k, v in land.items() if v is not None},
        "params_never_written": unwritten,
        "engine_owned_never_written": owned,
    }


def skipped_by_prefix(ours: dict[str, torch.Tensor], prefixes: tuple[str, ...], why: str) -> dict[str, str]:
    """The export tensors under ``prefixes`` (a block the engine's main-model class skips by name, e.g. an MTP
    drafter's ``mtp.``), each with ``why``."""
    return {k: why for k in ours if k.startswith(prefixes)}


def transformed_into(ours: dict[str, torch.Tensor], params: dict[str, torch.Tensor], name: str, param: str,
                     fn: Callable[[torch.Tensor], torch.Tensor], what: str) -> dict[str, str]:
    """``{name: what}`` when the engine parameter ``param`` holds exactly ``fn(ours[name])`` in its own dtype
    (a load-time transform the engine's class applies, e.g. Mamba's ``A = -exp(A_log)``); else nothing, so the
    tensor stays "not landed"."""
    p = params.get(param)
    if name not in ours or p is None:
        return {}
    want = fn(ours[name]).to(p.dtype).reshape(p.shape) if fn(ours[name]).numel() == p.numel() else None
    return {name: what} if want is not None and torch.equal(p.detach().cpu(), want) else {}


# ----------------------------------------------------------------------------------- post-load scales

# Engine attribute -> (role, what it must equal in terms of the export's own weight_scale_2 ``w`` and
# input_scale ``a``). Roles: "lin" (a Linear or a fused group of them), "w13"/"w1"/"w3"/"w2" (routed
# experts: the gate/up GEMM, one half of it, the down GEMM).
W, A, WA, INV_A = "w", "a", "w*a", "1/a"
SCALE_RULES: dict[str, tuple[str, str]] = {
    "weight_scale_2": ("lin", W),
    "weight_global_scale": ("lin", W),
    "input_scale": ("lin", A),
    "input_global_scale": ("lin", A),
    "input_scale_inv": ("lin", INV_A),
    "input_global_scale_inv": ("lin", INV_A),
    "alpha": ("lin", WA),
    "w13_weight_scale_2": ("w13", W),
    "w2_weight_scale_2": ("w2", W),
    "w13_input_scale": ("w13", A),
    "w2_input_scale": ("w2", A),
    "g1_alphas": ("w1", WA),
    "g1_alphas_up": ("w3", WA),
    "g2_alphas": ("w2", WA),
    "w13_input_scale_quant": ("w13", INV_A),
    "w2_input_scale_quant": ("w2", INV_A),
    "a1_gscale": ("w13", INV_A),
    "a2_gscale": ("w2", INV_A),
}
TOLERANCE = 1e-6  # relative; fp32 products and reciprocals of the same numbers agree to ~1e-7


def _scalar(ours: dict[str, torch.Tensor], key: str) -> float | None:
    t = ours.get(key)
    if t is None or t.numel() != 1 or not t.dtype.is_floating_point or t.element_size() < 2:
        return None
    return float(t.double())


def _expected(what: str, ours: dict[str, torch.Tensor], modules: list[str]) -> list[float] | None:
    """``what`` for each export module (None when a module lacks a scale it needs)."""
    out = []
    for m in modules:
        w, a = _scalar(ours, f"{m}.weight_scale_2"), _scalar(ours, f"{m}.input_scale")
        if (w is None and "w" in what) or (a is None and "a" in what):
            return None
        out.append({W: w, A: a, WA: (w or 0) * (a or 0), INV_A: 1 / a if a else 0.0}[what])
    return out


def compare_scales(scales: dict[str, dict[str, torch.Tensor]], ours: dict[str, torch.Tensor],
                   pieces: Callable[[str], dict[str, list[list[str]]] | None],
                   rules: dict[str, tuple[str, str]] = SCALE_RULES) -> dict:
    """Each post-load scale the engine holds against what the export's scales say it must be.

    ``pieces(engine_module)`` names the export modules behind an engine module, per role:
    ``{"lin": [[m1], [m2], ...]}`` for a Linear or fused group (one row per shard), or
    ``{"w1"/"w3"/"w2": [[expert 0's module], [expert 1's], ...]}`` for routed experts.
    """
    compared, worst, mismatches, unknown = 0, 0.0, [], set()
    for module, attrs in scales.items():
        roles = pieces(module)
        if not roles:
            continue
        for attr, value in attrs.items():
            rule = rules.get(attr)
            if rule is None:
                unknown.add(attr)
                continue
            role = rule[0]
            halves = ("w1", "w3") if role == "w13" else (role,)
            flat = value.reshape(-1)
            for h_i, half in enumerate(halves):
                rows = roles.get("lin" if role == "lin" else half)
                if not rows:
                    continue
                for r_i, row in enumerate(rows):
                    exp = _expected(rule[1], ours, row)
                    if exp is None:
                        continue
                    if flat.numel() == 1:
                        got = float(flat[0])
                    elif value.dim() == 2 and value.shape == (len(rows), 2) and role == "w13":
                        got = float(value[r_i, h_i])
                    elif flat.numel() == len(rows):
                        got = float(flat[r_i])
                    else:
                        continue
                    for e in exp:
                        err = abs(got - e) / max(abs(e), 1e-30)
                        compared += 1
                        worst = max(worst, err)
                        if err > TOLERANCE:
                            mismatches.append({"param": f"{module}.{attr}", "index": r_i, "half": half,
                                               "engine": got, "export_says": e, "rel": err, "export": row})
    return {"compared": compared, "max_rel": worst, "mismatches": mismatches[:50],
            "mismatch_count": len(mismatches), "unruled": sorted(unknown)}


def merge_post(post: dict, more: dict) -> dict:
    """``post`` (``compare_scales``' answer) with another comparison's counts and mismatches added."""
    post["compared"] += more.get("compared", 0)
    post["max_rel"] = max(post["max_rel"], more.get("max_rel", 0.0))
    post["mismatches"] = (post["mismatches"] + more.get("mismatches", []))[:50]
    post["mismatch_count"] += len(more.get("mismatches", []))
    for key, value in more.items():
        if key not in ("compared", "max_rel", "mismatches"):
            post[key] = value
    return post


def _value(v) -> float | None:
    if isinstance(v, torch.Tensor):
        return float(v.detach().double().reshape(-1)[0]) if v.numel() == 1 else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def compare_kv_scales(model: torch.nn.Module, ours: dict[str, torch.Tensor], attrs: dict[str, str]) -> dict:
    """The KV-cache scales an engine computes with after post-processing, against the export's.

    The export holds one ``<layer>.self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` per layer; every module under
    ``<layer>.`` (engine names keep the layer prefix) holding an attribute of ``attrs`` (engine attribute ->
    ``"k"``/``"v"``: a tensor of one element or a float) is compared with that layer's scale. Engine modules that
    hold such an attribute in a layer whose export has no scale are listed (``kv_unmatched``), not judged."""
    want: dict[str, dict[str, float]] = {}
    for key, t in ours.items():
        for kind in ("k", "v"):
            if key.endswith(f".self_attn.{kind}_proj.{kind}_scale") and t.numel() == 1:
                want.setdefault(key.split(".self_attn.")[0], {})[kind] = float(t.double())
    compared, worst, mismatches, unmatched = 0, 0.0, [], []
    for mname, module in model.named_modules():
        for attr, kind in attrs.items():
            got = _value(getattr(module, attr, None))
            if got is None:
                continue
            layer = next((p for p in want if mname.startswith(p + ".")), None)
            if layer is None or kind not in want[layer]:
                unmatched.append(f"{mname}.{attr}")
                continue
            e = want[layer][kind]
            err = abs(got - e) / max(abs(e), 1e-30)
            compared += 1
            worst = max(worst, err)
            if err > TOLERANCE:
                mismatches.append({"param": f"{mname}.{attr}", "index": 0, "half": kind, "engine": got,
                                   "export_says": e, "rel": err,
                                   "export": [f"{layer}.self_attn.{kind}_proj.{kind}_scale"]})
    return {"compared": compared, "max_rel": worst, "mismatches": mismatches, "kv_unmatched": unmatched[:20]}


def pieces_by_name(ours: dict[str, torch.Tensor], fused: dict[str, tuple[str, ...]],
                   expert_projs: dict[str, str]) -> Callable[[str], dict[str, list[list[str]]] | None]:
    """``compare_scales``' ``pieces`` for an engine that keeps the checkpoint's module names: an engine module
    is an export module, a fused one (``fused``: engine name -> checkpoint pieces, in shard order) or a routed
    experts module whose experts hold ``expert_projs`` (role ``w1``/``w3``/``w2`` -> checkpoint projection)."""
    modules = {k.rpartition(".")[0] for k in ours}

    def pieces(engine_module: str):
        if engine_module in modules:
            return {"lin": [[engine_module]]}
        parent, _, last = engine_module.rpartition(".")
        if last in fused:
            row = [f"{parent}.{p}" for p in fused[last] if f"{parent}.{p}" in modules]
            return {"lin": [[m] for m in row]} if row else None
        n = 0
        while f"{engine_module}.{n}.{expert_projs['w1']}" in modules:
            n += 1
        if n:
            return {role: [[f"{engine_module}.{e}.{proj}"] for e in range(n)] for role, proj in expert_projs.items()}
        return None

    return pieces


# ----------------------------------------------------------------------------------- kernel stand-ins


def interleave_block_scales(sf: torch.Tensor) -> torch.Tensor:
    """The 128x4 block-scale layout of NVFP4 GEMMs (FORMATS.md-style statement of flashinfer's
    ``block_scale_interleave``, which is a CUDA kernel): per matrix, rows padded to 128 and columns to
    4; each 128x4 tile stored as [row % 32][row // 32 % 4][col % 4]; tiles row-major. Flattened, as
    the kernel returns it."""
    batch = sf.shape[:-2] if sf.dim() > 2 else ()
    rows, cols = sf.shape[-2:]
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    x = sf.reshape(-1, rows, cols)
    padded = torch.zeros(x.shape[0], pr, pc, dtype=sf.dtype, device=sf.device)
    padded[:, :rows, :cols] = x
    tiles = padded.reshape(x.shape[0], pr // 128, 4, 32, pc // 4, 4).permute(0, 1, 4, 3, 2, 5)
    del batch
    return tiles.contiguous().reshape(-1)


def patch_flashinfer_interleave() -> None:
    """Serve flashinfer's block-scale interleave (a CUDA kernel) with ``interleave_block_scales``."""
    import importlib

    def interleave(unswizzled_sf: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        res = interleave_block_scales(unswizzled_sf)
        if out is not None:
            out.copy_(res)
            return out
        return res

    for mod in ("flashinfer", "flashinfer.quantization", "flashinfer.quantization.fp4_quantization"):
        m = importlib.import_module(mod)
        for name in ("block_scale_interleave", "nvfp4_block_scale_interleave"):
            if hasattr(m, name):
                setattr(m, name, interleave)


def check_interleave_against(engine_swizzle: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """The stand-in gives the engine's own torch swizzle's bytes (both engines keep one for CUTLASS)."""
    g = torch.Generator().manual_seed(0)
    sf = torch.randint(0, 256, (3, 200, 9), dtype=torch.uint8, generator=g)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # vLLM's moves its result to the GPU
    try:
        want = engine_swizzle(sf.view(torch.float8_e4m3fn)).reshape(-1).view(torch.uint8)
    finally:
        torch.Tensor.cuda = cuda
    return bool(torch.equal(interleave_block_scales(sf), want))


def without_gpu_driver(package: str) -> list[str]:
    """Import every compiled extension of ``package``; one that cannot load because the GPU driver
    library (libcuda.so.1) is absent is registered as an empty module, so the Python code around it
    imports. Its custom ops stay unregistered: a loader step that calls one raises (and is reported)."""
    import importlib
    import importlib.util
    import sys
    import types

    root = Path(importlib.util.find_spec(package).origin).parent
    missing = []
    for so in sorted(root.rglob("*.so")):
        rel = so.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts).split(".cpython")[0].split(".abi3")[0]
        if name in sys.modules:
            continue
        try:  # load the file itself: its package's __init__ may need it already present
            spec = importlib.util.spec_from_file_location(name, so)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except ImportError as exc:
            if "libcuda" in str(exc):
                sys.modules[name] = types.ModuleType(name)
                missing.append(name)
        except Exception:  # noqa: BLE001 - an extension that fails otherwise is left to fail where used
            continue
    return missing


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """Every tensor an engine asks to place on ``cuda`` is placed on the CPU (workspaces, buffers,
    ``.cuda()``/``.to("cuda")`` moves); nothing else about the call changes."""

    @staticmethod
    def _cpu(dev):
        if dev is None:
            return dev
        d = torch.device(dev) if isinstance(dev, (str, int)) and not isinstance(dev, bool) else dev
        return torch.device("cpu") if isinstance(d, torch.device) and d.type == "cuda" else dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._cpu(kwargs["device"])
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)) \
                and self._cpu(args[1]) != args[1]:
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)

"""Hugging Face checkpoints in and out: `load_hf_weights`, `save_hf_weights`, `save_weights`.

Parameters are a flat dict keyed by the paths of docs/contracts.md, per-layer ones stacked on axis 0.
The name/layout table lives in `tessera/lower/hf/mapping.py`, the arg ↔ config.json fields in
`tessera/lower/hf/config.py`. Given `model` (the .tsl file), `args` are laid over that file's declared
defaults before any check or export; without it they must already be the full arguments (an optional
one left out is neither checked nor written). Every problem found in a checkpoint (config mismatch,
missing, unexpected or mis-shaped tensor) is reported at once, in one TesseraError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from tessera.diagnostics import Diagnostic, TesseraError, did_you_mean, relpath
from tessera.lower.hf import mapping
from tessera.lower.hf import config as hf_config
from tessera.lower.hf.config import check_config, check_declared, dims_from_args, hf_config_from_args, read_config
from tessera.lower.hf.io import SINGLE, TensorSource
from tessera.lower.hf.mxfp4 import decode_packed, encode_mxfp4, packed_from_hf, packed_to_hf
from tessera.lower.reference.mxfp4 import MXFP4

__all__ = ["load_hf_weights", "save_hf_weights", "save_weights", "hf_config_from_args", "expected_params",
           "model_args"]

DtypeFn = Callable[[str], Any]


def expected_params(family_name: str, args: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter path a family's checkpoint holds, with its (stacked) Tessera shape."""
    fam = hf_config.family(family_name)
    dims = dims_from_args(fam, args)
    shapes = {}
    for rule in fam.rules(dims["tied"]):
        hf = jax.ShapeDtypeStruct(rule.hf_shape(dims), jnp.float32)  # shapes only: nothing is allocated
        outs = jax.eval_shape(lambda w, rule=rule: rule.transform.load(w, dims), hf)
        for path, arr in zip(rule.paths, outs):
            shapes[path] = ((dims["L"],) if rule.per_layer else ()) + arr.shape
    return shapes


def model_args(family: str, args: dict, model: str | Path | None) -> dict:
    """The arguments the checks and the export read: `args` over `model`'s declared defaults (`args` alone if None)."""
    if model is None:
        return dict(args)
    from tessera.ir.elaborate import bound_args

    full = bound_args(model, args)
    check_declared(hf_config.family(family), full, model)
    return full


def load_hf_weights(directory: str | Path, *, family: str, args: dict, model: str | Path | None = None,
                    dtypes: DtypeFn | None = None, packed: Collection[str] = (),
                    split_layers: bool = False) -> dict[str, Any]:
    """Read config.json + *.safetensors of an HF checkpoint into Tessera parameters {path: array}.

    Paths in `packed` become MXFP4 pytrees: an MXFP4 tensor's bytes are kept as stored (no decode), a
    dense one is quantised. Each tensor goes to the device as it is read, so the host holds one tensor at
    a time; per-layer parameters are then stacked on the device, or with `split_layers` kept as the list
    of their layers (no stacked copy is ever made)."""
    directory = Path(directory)
    fam = hf_config.family(family)
    args = model_args(family, args, model)
    config, config_path = read_config(directory)
    check_config(fam, config, args, config_path)
    dims = dims_from_args(fam, args)
    dtypes = dtypes or (lambda path: np.float32)
    source = TensorSource(directory)
    params, problems, consumed = {}, [], set()
    rules = fam.rules(dims["tied"])
    for rule in rules:
        names = mapping.expand(rule, dims["L"])
        consumed.update(names)
        layers = []
        for name in names:
            read = _read(source, name, rule, dims, directory, problems, dtypes, packed)
            layers.append(None if read is None or problems else jax.tree.map(jnp.asarray, read))
        if any(a is None for a in layers):
            continue
        for j, path in enumerate(rule.paths):
            parts = [a[j] for a in layers]
            if not rule.per_layer:
                params[path] = parts[0]
            else:
                params[path] = parts if split_layers else jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
        del layers
    known = [n for rule in rules for n in mapping.expand(rule, dims["L"])]
    for name in sorted(source.names() - consumed):
        if _tolerated(name, dims):
            continue
        problems.append(Diagnostic(f"unexpected tensor `{name}` in {relpath(source.where(name))}",
                                   hint=did_you_mean(name, known)))
    if problems:
        raise TesseraError(problems)
    return params


def _read(source: TensorSource, name: str, rule: mapping.Rule, dims: dict, directory: Path,
          problems: list, dtypes: DtypeFn, packed: Collection[str] = ()) -> tuple[Any, ...] | None:
    # one HF tensor -> its Tessera array(s) in their final dtypes (cast per layer, so that decoded MXFP4
    # never sits in memory in fp32 for all layers at once), or None after recording what is wrong with it
    want = rule.hf_shape(dims)
    if name not in source:
        problems.append(Diagnostic(f"missing tensor `{name}` (shape {list(want)}, for "
                                   f"{' and '.join(f'`{p}`' for p in rule.paths)}) in {relpath(directory)}"))
        return None
    got = source.shape(name)
    if got != want:
        problems.append(Diagnostic(f"tensor `{name}` in {relpath(source.where(name))} has shape {list(got)}, "
                                   f"expected {list(want)} from model.args"))
        return None
    if all(path in packed for path in rule.paths) and name in source.mxfp4 and rule.mxfp4:
        codes, scales = packed_from_hf(*source.get_packed(name))  # the bytes as stored, HF's transpose undone
        pairs = zip(rule.transform.load(codes, dims), rule.transform.load(scales, dims))
        return tuple(MXFP4(c, s) for c, s in pairs)
    outs = rule.transform.load(source.get(name), dims)
    return tuple(_pack(x) if path in packed else np.asarray(x, dtype=dtypes(path)) for x, path in zip(outs, rule.paths))


def _pack(w: np.ndarray) -> MXFP4:
    # a dense [..., K, N] weight quantised to Tessera's packed layout (the HF encoder, then its layout undone)
    return MXFP4(*packed_from_hf(*encode_mxfp4(w)))


def _tolerated(name: str, dims: dict) -> bool:
    # buffers that hold no parameter, and a copy of the embedding in tied checkpoints (HF ignores both)
    if any(p.search(name) for p in mapping.IGNORED):
        return True
    return dims["tied"] and name == "lm_head.weight"


def save_hf_weights(params: dict[str, jax.Array], directory: str | Path, *, family: str, args: dict,
                    model: str | Path | None = None, extra_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors in HF format (opens with `from_pretrained`); returns the dir."""
    directory = Path(directory)
    fam = hf_config.family(family)
    args = model_args(family, args, model)
    dims = dims_from_args(fam, args)
    expected = expected_params(fam.name, args)
    _check_params(params, expected)
    tensors = {}
    rules = fam.rules(dims["tied"])
    keep_packed = {rule.hf for rule in rules if rule.mxfp4 and all(isinstance(params[p], MXFP4) for p in rule.paths)}
    for rule in rules:
        arrays = [jax.tree.map(np.asarray, jax.device_get(params[p])) for p in rule.paths]
        if rule.hf not in keep_packed:  # HF holds this tensor dense: dequantise any packed part
            arrays = [decode_packed(a) if isinstance(a, MXFP4) else a for a in arrays]
        names = mapping.expand(rule, dims["L"])
        for i, name in enumerate(names):
            parts = tuple(jax.tree.map(lambda x: x[i], a) for a in arrays) if rule.per_layer else tuple(arrays)
            if rule.hf in keep_packed:  # codes and scales through the same layout change, then HF's transpose
                blocks, scales = packed_to_hf(rule.transform.save(tuple(a.codes for a in parts), dims),
                                              rule.transform.save(tuple(a.scales for a in parts), dims))
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = np.ascontiguousarray(rule.transform.save(parts, dims))
    directory.mkdir(parents=True, exist_ok=True)
    if keep_packed:  # transformers' MXFP4 loader: every module not listed here holds MXFP4 experts
        extra_config = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": list(
            mapping.MXFP4_NOT_CONVERTED)}, **(extra_config or {})}
    config = hf_config_from_args(fam.name, args, extra_config)
    config.setdefault("dtype", str(np.asarray(params["embed/table"]).dtype))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / SINGLE), metadata={"format": "pt"})
    return directory


def _check_params(params: dict, expected: dict[str, tuple[int, ...]]) -> None:
    # every expected parameter present with its shape, nothing else
    problems = [Diagnostic(f"parameter `{p}` is missing (shape {list(s)})") for p, s in expected.items()
                if p not in params]
    problems += [Diagnostic(f"parameter `{p}` has shape {list(params[p].shape)}, expected {list(s)}")
                 for p, s in expected.items() if p in params and tuple(params[p].shape) != s]
    problems += [Diagnostic(f"parameter `{p}` has no place in a Hugging Face checkpoint",
                            hint=did_you_mean(p, expected)) for p in sorted(set(params) - set(expected))]
    if problems:
        raise TesseraError(problems)


def save_weights(params: dict[str, jax.Array], directory: str | Path, *, options, graph=None) -> Path:
    """Save in HF format for compile options (CompileOptions): the family is the model file's stem, sizes its
    bound arguments.

    Params held padded on the options' mesh (storage.padding: a moe's d_ff) are sliced back to the IR's shapes
    of `graph` (the program's graph, `program_graph(exp)`; needed only on a mesh) first, so the export has exactly
    HF's shapes and bytes."""
    from tessera.lower import storage

    if options.mesh_size > 1:  # padding exists only on a mesh (storage.padding)
        if graph is None:
            raise ValueError("save_weights on a mesh needs the program's graph (params may be held padded)")
        pads = storage.padding(options, graph)
        params = {path: storage.resize(v, tuple(d.size for d in graph.params[path].type.dims))
                  if path in pads else v for path, v in params.items()}
    return save_hf_weights(params, directory, family=options.model_file.stem, args=dict(options.model_args),
                           model=options.model_file)

"""Model and GPU presets (with each GPU's host link), and models read from a small YAML or
JSON file.

A model file may be flat (`hidden: 4096`) or a whole nanotron config: the keys are
looked for anywhere in it, in our spelling (layers, hidden, heads, kv_heads, ffn, vocab)
or nanotron's / Hugging Face's (num_hidden_layers, hidden_size, num_attention_heads,
num_key_value_heads, intermediate_size, vocab_size). YAML is read by PyYAML where it is
installed (as nanotron reads it, `read_yaml`); PyYAML is not needed: without it
`parse_yaml` reads the subset of YAML that configs use (nested mappings by indentation,
scalars, comments, `- item` lists and `[a, b]` inline lists) and refuses what it does not
read (anchors, aliases, tags, block scalars). JSON files are read as JSON.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

from pipeschedule.errors import FormatError, ParameterError
from pipeschedule.plan.memory import GiB, ModelSpec
from pipeschedule.checks import check_number, is_int, shown

MODELS = {
    "llama3-8b": ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama3-70b": ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
    "llama3-405b": ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256),
}

# Nominal capacity read as GiB (nvidia-smi reports totals within about 1% of it).
# Dense bf16 peak TFLOP/s, for absolute time estimates only.
GPUS = {
    "gh200": {"memory": 96 * GiB, "tflops": 989.0, "hbm": 4.0, "label": "NVIDIA GH200 96 GB"},
    "h100": {"memory": 80 * GiB, "tflops": 989.0, "label": "NVIDIA H100 80 GB"},
    "h200": {"memory": 141 * GiB, "tflops": 989.0, "hbm": 4.8, "label": "NVIDIA H200 141 GB"},
}

# Host link bandwidth per direction, GB/s, by GPU preset: GH200's NVLink-C2C (900 GB/s
# both directions together, as the vendor quotes it) and the H200 lent here (pinned
# copies measured at 55.4 GB/s each way, issue 9).
HOST_LINKS = {"gh200": 450.0, "h200": 55.4}
# The presets whose host link was measured here, and how ([Note: offload advice] in
# plan/config.py); the others' figure is the vendor's.
MEASURED_HOST_LINKS = {"h200": "pinned copies timed at 55.4 GB/s each way on the H200 lent here (issue 9)"}

# nanotron's model.dtype values a plan counts, and the bytes of a weight and of an
# activation value under each (nanotron's default is bfloat16).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

_KEYS = {
    "layers": ("layers", "num_hidden_layers", "num_layers", "n_layers"),
    "hidden": ("hidden", "hidden_size", "d_model"),
    "heads": ("heads", "num_attention_heads", "n_heads"),
    "kv_heads": ("kv_heads", "num_key_value_heads", "n_kv_heads"),
    "ffn": ("ffn", "intermediate_size", "ffn_hidden_size"),
    "vocab": ("vocab", "vocab_size"),
    "tied_embeddings": ("tied_embeddings", "tie_word_embeddings"),
}


def model_preset(name: str) -> ModelSpec:
    key = name.lower().replace("_", "-")
    if key not in MODELS:
        raise ParameterError(f"unknown model {shown(name)}; presets: {', '.join(MODELS)} "
                             "(or give --model-file / the sizes as flags)")
    return MODELS[key]


def gpu_preset(name: str) -> dict:
    key = preset_key(name, GPUS)
    if key is not None:
        return GPUS[key]
    raise ParameterError(f"unknown GPU {shown(name)}; presets: {', '.join(GPUS)} (or give --gpu-memory in GiB)")


def host_bandwidth(gpu: str | None, given: float | None) -> float | None:
    """GB/s per direction: `given` (--host-bandwidth) when set, else the GPU preset's
    (HOST_LINKS), else None (unknown)."""
    if given is not None:
        return float(check_number("--host-bandwidth", given, above=True, hint=" (GB/s per direction)"))
    key = preset_key(gpu, HOST_LINKS)
    return None if key is None else HOST_LINKS[key]


def host_link_source(gpu: str | None, given: float | None) -> str | None:
    """Where the host link figure `host_bandwidth(gpu, given)` comes from: "given"
    (--host-bandwidth), "measured" (MEASURED_HOST_LINKS), "vendor" (a preset's datasheet
    figure), or None (no link known)."""
    if given is not None:
        return "given"
    key = preset_key(gpu, HOST_LINKS)
    if key is None:
        return None
    return "measured" if key in MEASURED_HOST_LINKS else "vendor"


def preset_key(gpu: str | None, table: dict) -> str | None:
    """The key of `table` (GPUS, HOST_LINKS, ...) that GPU preset name `gpu` means, as
    `gpu_preset` reads names (any case, dashes and spaces ignored, a longer name such as
    h200-141gb starting with the key); None where none does."""
    if not gpu:
        return None
    key = gpu.lower().replace("-", "").replace(" ", "")
    return next((name for name in table if key == name or key.startswith(name)), None)


def model_from_mapping(obj: Any, name: str = "custom") -> ModelSpec:
    """A ModelSpec from a (possibly nested) mapping; see the module docstring."""
    if not isinstance(obj, dict):
        raise FormatError(f"a model description must be a mapping, got {type(obj).__name__}")
    found: dict[str, Any] = {}
    for field, aliases in _KEYS.items():
        value = _find(obj, aliases)
        if value is not None:
            found[field] = value
    if "kv_heads" not in found and "heads" in found:
        found["kv_heads"] = found["heads"]  # nanotron's default: no GQA
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in found]
    if missing:
        raise FormatError(
            f"model description lacks {', '.join(missing)} (accepted spellings: "
            + "; ".join(f"{k}: {'/'.join(_KEYS[k])}" for k in missing) + ")"
        )
    for key, value in found.items():
        if key == "tied_embeddings":
            if not isinstance(value, bool):
                raise FormatError(f"model tied_embeddings must be true or false, got {shown(value)}")
        elif not is_int(value):
            raise FormatError(f"model {key} must be an integer, got {shown(value)}")
    # a name at the top only: deeper `name`s in a nanotron config are a data stage's or the optimizer's
    given = obj.get("name")
    return ModelSpec(name=given if isinstance(given, str) and given else name, **found)


def _find(obj: Any, keys: tuple[str, ...]) -> Any:
    """The first value under any of `keys`, searching nested mappings breadth-first, each
    node once (YAML aliases make one node reachable many times: a few lines can reach it
    10^9 times)."""
    queue, seen = [obj], set()
    while queue:
        node = queue.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            for key in keys:
                if key in node and not isinstance(node[key], (dict, list)):
                    return node[key]
            queue.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            queue.extend(v for v in node if isinstance(v, (dict, list)))
    return None


def load_model(path: str, mapping: Any = None) -> ModelSpec:
    """Read a model from a YAML or JSON file (see the module docstring); `mapping`: the
    file's contents where the caller has read them already (`load_mapping`)."""
    obj = load_mapping(path) if mapping is None else mapping
    return model_from_mapping(obj, name=re.sub(r"\.(ya?ml|json)$", "", path.rsplit("/", 1)[-1]))


def load_mapping(path: str) -> Any:
    """The contents of a YAML or JSON file (JSON when it starts with `{`)."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is skipped
            text = handle.read()
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: NUL in the path
        raise FormatError(f"cannot read model file {path}: {err}") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as err:  # ValueError: also ints over 4300 digits
            raise FormatError(f"model file {path} is not valid JSON: {err}") from None
    else:
        obj = read_yaml(text, path)
    return obj


def read_yaml(text: str, source: str = "<yaml>") -> Any:
    """YAML as nanotron reads its configs: PyYAML's safe loader where PyYAML is installed
    (nanotron needs it, so a config the launcher trains reads here as it reads there:
    anchors, folded strings and all), else `parse_yaml`'s subset. Text that is no YAML is
    refused in one line; a value PyYAML cannot build (a 5000-digit integer, nesting past
    the recursion limit) is read by `parse_yaml`, whose reading or error stands (the
    integer is then a string that the model's checks name)."""
    try:
        import yaml  # optional: the compiler and the planner need no package
    except ImportError:
        return parse_yaml(text, source)
    stream = io.StringIO(text)
    stream.name = source  # PyYAML's messages name the file and the line
    try:
        obj = yaml.safe_load(stream)
    except yaml.YAMLError as err:
        raise FormatError(f"{source} is not valid YAML: {' '.join(str(err).split())}") from None
    except (ValueError, RecursionError):
        return parse_yaml(text, source)
    return {} if obj is None else obj


# [Note: a nanotron config's layout] A nanotron config names the layout it trains with;
# `plan --model-file` plans that layout, not the flags' defaults, unless a flag sets a
# value. Where nanotron fills in a key the file leaves out, its default is what runs:
# tp_mode ALL_REDUCE (no sequence parallelism) and tp_linear_async_communication false
# (nanotron/config/parallelism_config.py, ParallelismArgs.__post_init__), model.dtype
# bfloat16 (nanotron/config/config.py, ModelArgs.__post_init__).
NANOTRON_LAYOUT = {  # plan option: (section, key) of a nanotron config
    "pp": ("parallelism", "pp"), "tp": ("parallelism", "tp"), "dp": ("parallelism", "dp"),
    "sequence_parallel": ("parallelism", "tp_mode"),
    "tp_async": ("parallelism", "tp_linear_async_communication"),
    "seq": ("tokens", "sequence_length"), "micro_batch": ("tokens", "micro_batch_size"),
    "microbatches": ("tokens", "batch_accumulation_per_replica"),
    "zero": ("optimizer", "zero_stage"), "fp32_grad_accum": ("optimizer", "accumulate_grad_in_fp32"),
    "adam_fused": ("optimizer", "torch_adam_is_fused"), "dtype": ("model", "dtype"),
}
TP_MODES = {"REDUCE_SCATTER": True, "ALL_REDUCE": False}


def nanotron_layout(obj: Any, source: str) -> dict[str, tuple[Any, str]]:
    """{plan option: (value, where in the file)} of a nanotron config ([Note: a nanotron
    config's layout]); {} for a file without a `parallelism` mapping (a model file). A
    value of the wrong kind is refused, naming the key and the file."""
    if not isinstance(obj, dict) or not isinstance(obj.get("parallelism"), dict):
        return {}
    out: dict[str, tuple[Any, str]] = {}
    for option, (section, key) in NANOTRON_LAYOUT.items():
        where = f"{section}.{key}"
        part = obj.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if value is None and option == "adam_fused" and isinstance(part, dict):
            factory = part.get("optimizer_factory")  # nanotron after 0.4 nests it
            value = factory.get(key) if isinstance(factory, dict) else None
            where = f"{section}.optimizer_factory.{key}"
        if value is None:
            if option == "sequence_parallel":
                out[option] = (False, f"{where} not set: nanotron's ALL_REDUCE")
            elif option == "tp_async":
                out[option] = (False, f"{where} not set: nanotron's false")
            elif option == "dtype" and isinstance(part, dict):
                out[option] = ("bfloat16", f"{where} not set: nanotron's bfloat16")
            continue
        if option == "sequence_parallel":
            mode = value.upper() if isinstance(value, str) else None
            if mode not in TP_MODES:
                raise FormatError(f"{source}: {where} must be one of {', '.join(TP_MODES)}, got {shown(value)}")
            out[option] = (TP_MODES[mode], where)
        elif option in ("tp_async", "fp32_grad_accum", "adam_fused"):
            if not isinstance(value, bool):
                raise FormatError(f"{source}: {where} must be true or false, got {shown(value)}")
            out[option] = (value, where)
        elif option == "dtype":
            if value not in DTYPE_BYTES:
                raise FormatError(f"{source}: {where} must be one of {', '.join(DTYPE_BYTES)} (the dtypes the plan "
                                  f"counts), got {shown(value)}")
            out[option] = (value, where)
        elif option == "zero":
            if not is_int(value) or value not in (0, 1):
                raise FormatError(f"{source}: {where} must be 0 or 1 (the ZeRO stages nanotron's Llama trains "
                                  f"with), got {shown(value)}")
            out[option] = (str(value), where)
        else:
            if not is_int(value) or value < 1:
                raise FormatError(f"{source}: {where} must be an integer >= 1, got {shown(value)}")
            out[option] = (value, where)
    return out


# -- a small YAML subset ---------------------------------------------------------------------

# YAML 1.1's booleans as PyYAML reads them (nanotron's reader): not y/n, not tRUE or oN.
_TRUE = ("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON")
_FALSE = ("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF")


def parse_scalar(text: str) -> Any:
    """A YAML scalar: null, booleans (true/yes/on and false/no/off in lower, title or upper
    case, as PyYAML's YAML 1.1 reads them, which nanotron uses; not y/n), ints (with _ or
    e-notation that is integral, as YAML 1.1 reads them; ASCII digits only), floats,
    quoted or plain strings, and `[a, b]` inline lists of scalars."""
    text = text.strip()
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text[0] in "&*!|>":
        raise FormatError(f"YAML anchors, aliases, tags and block scalars ({shown(text)}) are read with PyYAML, as "
                          "nanotron reads its configs: pip install pyyaml")
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [parse_scalar(part) for part in inner.split(",")] if inner else []
    if text.startswith("{") and text.endswith("}"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    plain = text.replace("_", "")
    if len(plain) > 40:  # no number a model needs; int() of thousands of digits raises
        return text
    if re.fullmatch(r"[+-]?[0-9]+", plain):  # not \d, which takes every script's digits
        return int(plain)
    if re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", plain):
        value = float(plain)
        return int(value) if value.is_integer() and "e" in plain.lower() and "." not in plain else value
    return text


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def parse_yaml(text: str, source: str = "<yaml>") -> Any:
    """Parse the YAML subset described in the module docstring; raises FormatError."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip() in ("---", "..."):
            continue
        line = _strip_comment(raw).rstrip()
        if line.strip():
            if "\t" in line[: len(line) - len(line.lstrip())]:
                raise FormatError(f"{source}:{number}: tabs are not allowed in YAML indentation")
            lines.append((number, len(line) - len(line.lstrip()), line.strip()))
    if not lines:
        return {}
    value, index = _block(lines, 0, lines[0][1], source)
    if index != len(lines):
        number = lines[index][0]
        raise FormatError(f"{source}:{number}: unexpected indentation")
    return value


def _block(lines, index, indent, source):
    content = lines[index][2]
    if content.startswith("- ") or content == "-":
        return _sequence(lines, index, indent, source)
    return _mapping(lines, index, indent, source)


def _mapping(lines, index, indent, source):
    out: dict[str, Any] = {}
    while index < len(lines):
        number, ind, content = lines[index]
        if ind < indent:
            break
        if ind > indent:
            raise FormatError(f"{source}:{number}: unexpected indentation")
        key, sep, rest = content.partition(":")
        if not sep or (rest and not rest.startswith(" ")):
            raise FormatError(f"{source}:{number}: expected 'key: value', got {shown(content)}")
        key = key.strip().strip("'\"")
        rest = rest.strip()
        index += 1
        if rest:
            out[key] = parse_scalar(rest)
        elif index < len(lines) and (lines[index][1] > indent
                                     or (lines[index][1] == indent and lines[index][2].startswith("-"))):
            out[key], index = _block(lines, index, lines[index][1], source)
        else:
            out[key] = None
    return out, index


def _sequence(lines, index, indent, source):
    out: list[Any] = []
    while index < len(lines):
        number, ind, content = lines[index]
        if ind < indent or not (content.startswith("- ") or content == "-"):
            break
        if ind > indent:
            raise FormatError(f"{source}:{number}: unexpected indentation")
        item = content[1:].strip()
        index += 1
        if not item:
            if index < len(lines) and lines[index][1] > indent:
                value, index = _block(lines, index, lines[index][1], source)
                out.append(value)
            else:
                out.append(None)
        elif re.match(r"^[^'\"\[{][^:]*:( |$)", item):
            # "- key: value" starts a mapping whose other keys are indented further.
            sub = [(number, ind + 2, item)]
            while index < len(lines) and lines[index][1] > indent:
                sub.append(lines[index])
                index += 1
            value, used = _mapping(sub, 0, ind + 2, source)
            if used != len(sub):
                raise FormatError(f"{source}:{sub[used][0]}: unexpected indentation")
            out.append(value)
        else:
            out.append(parse_scalar(item))
    return out, index


__all__ = ["DTYPE_BYTES", "GPUS", "HOST_LINKS", "MEASURED_HOST_LINKS", "MODELS", "NANOTRON_LAYOUT", "gpu_preset",
           "host_bandwidth", "host_link_source", "load_mapping", "load_model", "model_from_mapping", "model_preset",
           "nanotron_layout", "parse_scalar", "parse_yaml", "preset_key", "read_yaml"]

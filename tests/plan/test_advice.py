"""What `pipeschedule plan` prints by default: one table of the best plan per dp asked,
one Recommended line against one baseline named in words, the nanotron YAML that pins
it (loaded here by nanotron's own loader and fed back to `plan --model-file`), what the
YAML cannot say in words, offload recommended only over a trusted link, and a warning
with the bubble when there are fewer microbatches than stages ([Note: plan advice],
[Note: plan YAML], [Note: offload advice])."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import yaml

import integration.nanotron  # noqa: F401  (nanotron's loader taught our pp_engine values, as a launcher does)
from integration.nanotron.pipeline.engine_spec import parse_engine
from integration.nanotron.example import TrainerConfig
from nanotron.config import get_config_from_file
from pipeschedule.cli import main
from pipeschedule.plan import PlanConfig, plan
from pipeschedule.plan.advice import advise, bubble
from pipeschedule.plan.config import build_config
from pipeschedule.plan.fitting import OffloadCandidate
from pipeschedule.plan.memory import GiB, TrainingSetup
from pipeschedule.plan.presets import MODELS

SMALL = ["--model", "llama3-8b", "--pp", "2", "--tp", "2", "--microbatches", "4", "--virtual", "2", "--gpu", "h100"]


def run(argv, capsys):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def yaml_block(text: str) -> str:
    """The YAML the text prints for the recommendation."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("nanotron config of the recommendation")) + 2
    end = lines.index("", start)
    return textwrap.dedent("\n".join(lines[start:end])) + "\n"


def merged(fragment: dict, base: dict) -> dict:
    """`base` with `fragment` merged in, mapping by mapping."""
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merged(value, base[key]) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def test_the_default_output_is_one_table_one_recommendation_and_its_yaml(capsys):
    code, out, _ = run(SMALL + ["--dp", "1,2,4"], capsys)
    assert code == 0
    lines = out.split("\n")
    assert len(lines) < 70, len(lines)  # today's detail was 300-450 lines
    header = next(i for i, line in enumerate(lines) if line.startswith(" dp  ZeRO  recompute  pp_engine"))
    rows = lines[header + 1:header + 4]
    assert [int(row.split()[0]) for row in rows] == [1, 2, 4]
    recommended = [line for line in lines if "Recommended" in line]
    assert len(recommended) == 1 and recommended[0].startswith("Recommended: dp=")
    # one baseline, in words, in the table's key and the recommendation alike
    words = "nanotron's default, 1F1B with its layer split (pp_engine: "
    assert words in recommended[0] and lines[header + 4].startswith("x: tokens/s per GPU against the baseline, "
                                                                    + words)
    assert re.search(r"\), at dp=1, ZeRO-0, (no|selective|full) recompute", recommended[0])
    # the ratio of the row recommended is the one in the line
    ratio = re.search(r": (\d\.\d{3})x the tokens/s per GPU", recommended[0]).group(1)
    dp = int(re.match(r"Recommended: dp=(\d+)", recommended[0]).group(1))
    assert next(row for row in rows if int(row.split()[0]) == dp).split()[-1] == ratio
    assert "Assumed by the estimate, with no key in nanotron's config:" in out
    assert "Memory per GPU" not in out and "split: nanotron = nanotron's own" not in out


def test_tables_all_keeps_the_detail_and_still_one_recommendation(capsys):
    _, out, _ = run(SMALL + ["--dp", "1,2", "--tables", "all"], capsys)
    assert out.count("Recommended") == 1
    assert out.count("Levers for llama3-8b") == 2 and "split: nanotron = nanotron's own" in out
    assert "Memory per GPU in GiB, #1 1f1b, nanotron default" in out
    _, top, _ = run(SMALL + ["--dp", "1,2", "--tables", "top"], capsys)
    assert top.count("Recommended") == 1 and "baseline, dp=1" in top and "Levers for" not in top


@pytest.mark.parametrize("flags", [
    ["--dp", "2", "--zero", "1", "--recompute", "full"],  # recompute travels in pp_engine
    ["--dp", "1,2", "--no-fp32-grad-accum", "--tp-async", "--no-adam-fused"],
    ["--dp", "1", "--recompute", "selective", "--dtype", "float32", "--no-sequence-parallel"],
])
def test_the_yaml_loads_with_nanotrons_loader_and_plans_the_same_again(flags, capsys, tmp_path):
    code, out, _ = run(SMALL + flags + ["--json"], capsys)
    summary = json.loads(out)["summary"]
    rec = summary["recommended"]
    assert code == 0 and rec is not None
    _, text, _ = run(SMALL + flags, capsys)
    fragment = yaml.safe_load(yaml_block(text))
    assert "\n".join(summary["yaml"]) + "\n" == yaml_block(text)
    # nanotron's own loader reads it, merged into a whole config of the launcher
    path = tmp_path / "config.yaml"
    whole = yaml.safe_load(TrainerConfig().yaml(str(tmp_path / "checkpoints")))
    path.write_text(yaml.safe_dump(merged(fragment, whole), sort_keys=False))
    config = get_config_from_file(str(path))
    engine = config.parallelism.pp_engine
    assert getattr(engine, "spec", parse_engine(rec["pp_engine"])) == parse_engine(rec["pp_engine"])
    c = rec["candidate"]
    assert c["pp_engine"] == rec["pp_engine"] or c["split_kind"].startswith("nanotron")
    p, o, t = config.parallelism, config.optimizer, config.tokens
    assert (p.dp, p.pp, p.tp, o.zero_stage) == (rec["dp"], 2, 2, rec["zero_stage"])
    assert (t.sequence_length, t.micro_batch_size, t.batch_accumulation_per_replica) == (8192, 1, 4)
    assert o.accumulate_grad_in_fp32 == ("--no-fp32-grad-accum" not in flags)
    assert o.torch_adam_is_fused == ("--no-adam-fused" not in flags)
    assert p.tp_linear_async_communication == ("--tp-async" in flags)
    assert p.tp_mode.name == ("ALL_REDUCE" if "--no-sequence-parallel" in flags else "REDUCE_SCATTER")
    assert str(config.model.dtype) == "torch." + ("float32" if "float32" in flags else "bfloat16")
    assert config.model.model_config.num_hidden_layers == 32 and config.model.model_config.num_key_value_heads == 8
    # the recompute the plan assumed is in pp_engine: the mode, or layers per stage
    spec, mode = parse_engine(rec["pp_engine"]), rec["recompute"]
    if mode == "partial":
        assert spec.recompute in (tuple(c["recomputed"]), c["recomputed"][0])
    else:
        assert spec.recompute == (None if mode == "none" else mode)
    # fed back with what is not a key of nanotron's (the GPU, the search's bounds, a recompute
    # mode asked for): the same layout, and the same recommendation
    again = tmp_path / "fragment.yaml"
    again.write_text(yaml_block(text))
    asked = flags.index("--recompute") if "--recompute" in flags else len(flags)
    searched = ["--gpu", "h100", "--virtual", "2", *flags[asked:asked + 2]]
    code, out, err = run(["--model-file", str(again), *searched, "--json"], capsys)
    assert code == 0 and "from the nanotron config" in err
    assert json.loads(out)["summary"]["yaml"] == summary["yaml"]


def test_the_readme_example_config_is_planned(capsys, tmp_path):
    """The README's `python -m integration.nanotron.example --pp 4 --engine
    capped_1f1b:cap=2 > config.yaml` then `plan --model-file config.yaml`: 4 layers at
    pp=4, nanotron's split 2/1/1/0 with the LM head alone on the last stage, which the
    launcher trains. The plan refused it ("a stage gets no decoder layer")."""
    path = tmp_path / "config.yaml"
    path.write_text(TrainerConfig(pp=4, engine="capped_1f1b:cap=2").yaml("checkpoints"))
    code, out, err = run(["--model-file", str(path), "--gpu", "gh200"], capsys)
    assert code == 0 and "Recommended: dp=1, ZeRO-0" in out, err
    fragment = yaml.safe_load(yaml_block(out))
    assert fragment["parallelism"]["pp"] == 4 and fragment["model"]["dtype"] == "float32"
    assert "dtype float32 (model.dtype)" in err  # the file's dtype, planned as it trains
    _, detail, _ = run(["--model-file", str(path), "--gpu", "gh200", "--tables", "all"], capsys)
    assert re.search(r"1f1b +nanotron default 2/1/1/0 ", detail)


@pytest.mark.parametrize("knobs", [
    dict(pp=4, layers=4), dict(pp=4, layers=2), dict(pp=2, tp=2, tp_mode="REDUCE_SCATTER"),
    dict(pp=2, dp=2, zero_stage=1, fp32_accumulation=True, dtype="bfloat16"), dict(pp=4, layers=8, tie_embeddings=True),
    dict(pp=3, layers=5, microbatches=2),
])
def test_configs_the_launcher_trains_are_planned(knobs, capsys, tmp_path):
    """integration/nanotron/example.py's configs, as the tests and the demo train them."""
    path = tmp_path / "config.yaml"
    path.write_text(TrainerConfig(**knobs).yaml("checkpoints"))
    code, out, err = run(["--model-file", str(path)], capsys)
    assert code == 0 and "Recommended: dp=" in out, err


def test_yaml_is_read_as_nanotron_reads_it(capsys, tmp_path):
    """PyYAML, as nanotron's loader: a string folded over two lines (yaml.dump folds long
    ones, as nanotron's save_as_yaml writes them) and anchors with aliases were refused or
    read as text by the subset reader; without PyYAML that reader names them."""
    from pipeschedule.errors import FormatError
    from pipeschedule.plan.presets import load_mapping, parse_yaml

    config = yaml.safe_load(TrainerConfig(pp=4, layers=8).yaml("checkpoints"))
    config["general"]["run"] = "a run of the four-stage pipeline with its stashes capped at two " * 2
    folded = yaml.safe_dump(config, sort_keys=False)
    assert "\n    " in folded.split("run: ")[1].split("\n  seed")[0]  # the string spans two lines
    anchored = (TrainerConfig(pp=4, layers=8).yaml("checkpoints")
                .replace("    max_position_embeddings: 16", "    max_position_embeddings: &seq 16")
                .replace("  sequence_length: 16", "  sequence_length: *seq"))
    for name, text in (("folded", folded), ("anchored", anchored)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        assert load_mapping(str(path)) == yaml.safe_load(text)
        code, out, err = run(["--model-file", str(path)], capsys)
        assert code == 0 and "seq 16 (tokens.sequence_length)" in err, err
        with pytest.raises(FormatError):
            parse_yaml(text)
    with pytest.raises(FormatError, match=re.escape("YAML anchors, aliases, tags and block scalars ('&seq 16')")):
        parse_yaml(anchored)
    (tmp_path / "bad.yaml").write_text("parallelism:\n  pp: [1, 2\n")
    code, _, err = run(["--model-file", str(tmp_path / "bad.yaml")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "bad.yaml is not valid YAML" in err


def test_fewer_microbatches_than_stages_warn_with_the_bubble(capsys):
    assert bubble(4, 2) == pytest.approx(3 / 5) and bubble(4, 4) == pytest.approx(3 / 7)
    code, out, err = run(["--model", "llama3-8b", "--pp", "4", "--microbatches", "2", "--zero", "0", "--recompute",
                          "full"], capsys)
    assert code == 0 and err == ""
    warning = [line for line in out.split("\n") if line.startswith("Warning:")]
    assert len(warning) == 1 and "2 microbatches per replica < pp=4" in warning[0]
    assert "(pp-1)/(m+pp-1) = 60% of the step, against 43% at m=pp" in warning[0]
    code, out, err = run(["--model", "llama3-8b", "--pp", "4", "--microbatches", "2", "--zero", "0", "--recompute",
                          "full", "--json"], capsys)
    assert json.loads(out)["summary"]["warnings"] == [warning[0][len("Warning: "):]]
    assert err.startswith("plan: warning: 2 microbatches")
    _, out, _ = run(["--model", "llama3-8b", "--pp", "4", "--microbatches", "4", "--zero", "0", "--recompute", "full"],
                    capsys)
    assert "Warning" not in out


# -- offload ------------------------------------------------------------------------------------


def users(**kw):
    """Llama3-70B at pp=4, tp=4, m=8 without recompute (async TP linears): on a GH200 the
    fastest row that fits streams every rank's stashes to the host."""
    return build_config("llama3-70b", pp=4, tp=4, microbatches=8, recompute="none", tp_async=True, virtual=2, **kw)


def test_offload_is_an_option_over_a_datasheet_link_and_recommended_when_asked():
    vendor = plan(users(gpu="gh200"))
    assert vendor.config.host_link_source == "vendor" and not vendor.config.offload_recommendable
    assert not isinstance(vendor.recommended, OffloadCandidate) and vendor.recommended.fits
    option = vendor.offload_option
    assert isinstance(option, OffloadCandidate) and option.fits
    assert option.step_time < vendor.recommended.step_time  # the option is faster: that is why it is shown
    # the user asks for it: with a host memory bound, or with the link they measured
    for kw in (dict(host_memory=1000), dict(host_bandwidth=450)):
        asked = plan(users(gpu="gh200", **kw))
        assert asked.config.offload_recommendable and asked.offload_option is None
        assert isinstance(asked.recommended, OffloadCandidate)
        assert asked.recommended.step_time == pytest.approx(option.step_time)
    # a preset whose link was measured
    measured = plan(PlanConfig(**{**vars_of(users(gpu="gh200")), "host_link_source": "measured"}))
    assert isinstance(measured.recommended, OffloadCandidate)


def vars_of(config: PlanConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_the_text_shows_the_offload_option_with_its_link(capsys):
    argv = ["--model", "llama3-70b", "--pp", "4", "--tp", "4", "--microbatches", "8", "--zero", "0", "--recompute",
            "none", "--tp-async", "--virtual", "2", "--gpu", "gh200"]
    _, out, _ = run(argv, capsys)
    recommended = next(line for line in out.split("\n") if line.startswith("Recommended"))
    assert "offload" not in recommended and "offload=" not in yaml_block(out)
    assert ("Not recommended, with host offload over a 450 GB/s link a direction (the GPU preset's datasheet figure; "
            "no offload plan has run over such a link; --host-memory GiB") in out
    assert re.search(r"\n  dp=1, ZeRO-0, no recompute: interleaved_1f1b:virtual=2,split=\S*offload=0/1/2/3\S*, "
                     r"\d\.\d{3}x, \d+\.\d GiB a GPU on the host", out)
    _, out, _ = run(argv + ["--host-memory", "100"], capsys)
    assert "offload=0/1/2/3" in yaml_block(out) and "Not recommended" not in out
    assert "host offload over a link of 450 GB/s a direction (the GPU preset's datasheet figure" in out


# -- several dp -----------------------------------------------------------------------------------


def test_several_dp_share_one_baseline_and_the_json_keeps_every_plan(capsys):
    code, out, _ = run(SMALL + ["--dp", "4,1,2,2", "--json"], capsys)
    obj = json.loads(out)
    assert code == 0 and [d["dp"] for d in obj["per_dp"]] == [1, 2, 4]
    for entry in obj["per_dp"]:  # each a lever search as `plan --json` gave it
        assert entry["best"] is not None and entry["levers"]
    summary = obj["summary"]
    assert summary["dp"] == [1, 2, 4] and summary["baseline"]["dp"] == 1
    best = [b for b in summary["best"] if b is not None]
    fastest = max(best, key=lambda b: b["relative_throughput"])
    assert summary["recommended"]["pp_engine"] == fastest["pp_engine"]
    assert summary["recommended"]["dp"] == fastest["dp"]
    # one dp, one combination: the single plan's object as before, and the summary beside it
    _, out, _ = run(SMALL + ["--zero", "0", "--recompute", "full", "--json"], capsys)
    single = json.loads(out)
    assert single["candidates"] and single["yaml"] == single["summary"]["yaml"]


def test_advise_recommends_the_most_tokens_per_gpu_against_the_smallest_dp():
    config = PlanConfig(MODELS["llama3-8b"], TrainingSetup(tp=2, recompute="full"), pp=2, microbatches=4,
                        gpu_memory=80 * GiB, virtual=2)
    advice = advise(config, (2, 1), zero=(0,), recompute=("full",))
    assert advice.dps == (1, 2) and advice.baseline.dp == 1 and advice.baseline.candidate is advice.searches[0].plans[
        (0, "full")].default
    assert advice.recommended is max((c for c in advice.best if c), key=lambda c: c.candidate.tokens_per_gpu)
    assert advice.ratio(advice.baseline) == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--dp", "0"], "--dp takes data-parallel sizes >= 1, got 0"),
    (["--dp", "1,x"], "--dp must be an integer or integers joined by / or ,"),
    (["--dp", "1/2,4"], "--dp joins its integers with one of / and ,"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
])
def test_bad_values_are_named_in_one_line(argv, message, capsys):
    code, _, err = run(["--model", "llama3-8b", "--pp", "4", "--microbatches", "8", *argv], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_nanotron_config_with_a_dtype_the_plan_does_not_count_is_named(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(TrainerConfig(pp=2).yaml("checkpoints").replace("dtype: float32", "dtype: float64"))
    code, _, err = run(["--model-file", str(path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "model.dtype must be one of bfloat16, float16, float32" in err and "'float64'" in err

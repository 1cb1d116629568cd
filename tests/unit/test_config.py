"""Config: loading and precedence, type checks, validation rules, TOML round trip, presets."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from megascale import config
from megascale.config import ConfigError, JobConfig, load, to_dict, to_toml, validate


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(overrides, world_size=1, backend="gloo", path="tiny"):
    """The ConfigError message validate raises for the tiny preset with these overrides."""
    cfg = load(path, overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size, backend)
    return str(info.value)


def assert_mentions(message, *fragments):
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


# --- loading and precedence ------------------------------------------------------------------------


def test_default_is_the_tiny_preset():
    cfg = load()
    assert cfg == load("tiny") == load("tiny.toml") == load(config.PRESETS_DIR / "tiny.toml")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (64, 4, 4)
    assert (cfg.model.seq_length, cfg.model.vocab_size) == (64, 256)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.steps) == (8, 2, 50)


def test_precedence_set_over_file_over_default(tmp_path):
    path = write(tmp_path, "[parallel]\ntp = 2\npp = 2\n[optim]\nlr = 0.5\n")
    cfg = load(path, ["parallel.tp=4", "optim.name=lamb"])
    assert cfg.parallel.tp == 4  # --set beats the file
    assert cfg.parallel.pp == 2  # the file beats the default
    assert cfg.optim.lr == 0.5
    assert cfg.optim.name == "lamb"  # bare word taken as a string
    assert cfg.parallel.vpp == JobConfig().parallel.vpp  # untouched: the default
    assert cfg.model == JobConfig().model


def test_later_set_wins_and_values_are_toml_literals(tmp_path):
    path = write(tmp_path, "")
    cfg = load(
        path,
        [
            "parallel.tp=2",
            "parallel.tp=8",
            "optim.lr=3e-4",
            "optim.beta2=1",  # an int is accepted for a float, and widened
            'model.spec="te"',
            "parallel.sequence_parallel=true",
            "data.path=/data/tokens/train",
            " model.window_size = 128 ",
        ],
    )
    assert cfg.parallel.tp == 8
    assert cfg.optim.lr == 3e-4
    assert cfg.optim.beta2 == 1.0 and isinstance(cfg.optim.beta2, float)
    assert cfg.model.spec == "te"
    assert cfg.parallel.sequence_parallel is True
    assert cfg.data.path == "/data/tokens/train"
    assert cfg.model.window_size == 128


def test_none_and_null_set_optional_fields(tmp_path):
    path = write(tmp_path, "[model]\nwindow_size = 256\nnum_query_groups = 2\n")
    assert load(path).model.window_size == 256
    cfg = load(path, ["model.window_size=none", "model.num_query_groups=NULL"])
    assert cfg.model.window_size is None
    assert cfg.model.num_query_groups is None


def test_none_is_refused_for_a_field_that_is_not_optional():
    with pytest.raises(ConfigError) as info:
        load(None, ["parallel.tp=none"])
    assert_mentions(str(info.value), "parallel.tp = none", "expected an integer")


def test_unknown_key_says_did_you_mean():
    with pytest.raises(ConfigError) as info:
        load(None, ["model.hiden_size=128"])
    assert_mentions(
        str(info.value), "unknown key model.hiden_size", "did you mean 'model.hidden_size'"
    )


def test_unknown_key_in_a_file_says_did_you_mean(tmp_path):
    path = write(tmp_path, "[model]\nhiden_size = 128\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert_mentions(str(info.value), str(path), "model.hiden_size", "'model.hidden_size'")


def test_key_in_the_wrong_section_points_to_the_right_one():
    with pytest.raises(ConfigError) as info:
        load(None, ["model.tp=2"])
    assert_mentions(str(info.value), "unknown key model.tp", "did you mean 'parallel.tp'")


def test_unknown_section_says_did_you_mean(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(None, ["modle.hidden_size=128"])
    assert_mentions(str(info.value), "unknown section 'modle'", "did you mean 'model'")
    path = write(tmp_path, "[paralel]\ntp = 2\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert_mentions(str(info.value), "unknown section 'paralel'", "did you mean 'parallel'")


def test_top_level_key_points_to_its_section(tmp_path):
    path = write(tmp_path, "tp = 2\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert_mentions(str(info.value), "unknown section 'tp'", "did you mean 'parallel.tp'")


def test_section_that_is_not_a_table(tmp_path):
    path = write(tmp_path, "model = 3\n")
    with pytest.raises(ConfigError, match=r"model = 3 must be a table"):
        load(path)


def test_malformed_override_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load(None, ["parallel.tp"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load(None, ["tp=2"])
    with pytest.raises(ConfigError, match="list of 'section.key=value' strings"):
        load(None, "parallel.tp=2")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[model\n"))


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError) as info:
        load("h100_1b")
    assert_mentions(str(info.value), "'h100_1b'", "did you mean 'h100-1b'", "tiny")


# --- types --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, fragments",
    [
        ('parallel.tp="two"', ["parallel.tp = 'two' (str)", "expected an integer"]),
        ("parallel.tp=two", ["parallel.tp = 'two' (str)", "expected an integer"]),
        ("parallel.tp=2.0", ["parallel.tp = 2.0 (float)", "expected an integer"]),
        ("parallel.tp=true", ["parallel.tp = True (bool)", "expected an integer"]),
        ("parallel.sequence_parallel=1", ["parallel.sequence_parallel = 1 (int)", "true or false"]),
        ("parallel.sequence_parallel=yes", ["parallel.sequence_parallel = 'yes'", "true or false"]),
        ("optim.lr=fast", ["optim.lr = 'fast' (str)", "expected a number"]),
        ("optim.lr=false", ["optim.lr = False (bool)", "expected a number"]),
        ("optim.name=3", ["optim.name = 3 (int)", "expected a string"]),
        ("model.window_size=1.5", ["model.window_size = 1.5", "an integer or none"]),
        ("model.num_query_groups=[2]", ["model.num_query_groups = [2] (list)", "an integer"]),
        ("train.profile_steps=[2.5, 3]", ["train.profile_steps = [2.5, 3]", "list of integers"]),
        ("train.profile_steps=3", ["train.profile_steps = 3 (int)", "a list of integers"]),
        ("train.memory_history=1", ["train.memory_history = 1 (int)", "true or false"]),
    ],
)
def test_wrong_types_are_refused(override, fragments):
    with pytest.raises(ConfigError) as info:
        load(None, [override])
    assert_mentions(str(info.value), *fragments, f"--set {override}")


def test_wrong_type_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path, '[parallel]\ntp = "2"\n')
    with pytest.raises(ConfigError) as info:
        load(path)
    assert_mentions(str(info.value), "parallel.tp = '2' (str)", str(path), "expected an integer")


def test_validate_type_checks_configs_built_in_code():
    cfg = JobConfig()
    cfg.parallel.tp = "2"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"parallel.tp = '2' \(str\): expected an integer"):
        validate(cfg, 2, "gloo")


# --- validation rules ------------------------------------------------------------------------------


def test_validate_fills_dp_and_returns_a_copy():
    cfg = load(None, ["parallel.tp=2", "parallel.pp=2"])
    out = validate(cfg, 8, "gloo")
    assert out.parallel.dp == 2
    assert cfg.parallel.dp is None  # the input is not changed
    assert validate(load(None, ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]), 8, "gloo")


VALIDATION_CASES = [
    # (overrides, world_size, backend, fragments that must be in the message)
    (["parallel.tp=3"], 8, "gloo", ["parallel.tp * parallel.pp = 3 * 1 = 3", "divide world_size = 8"]),
    (["parallel.dp=4"], 2, "gloo", ["parallel.dp = 4", "world_size / (tp * pp) = 2 / 1 = 2"]),
    (["parallel.tp=8", "model.hidden_size=96", "model.num_heads=12"], 8, "gloo",
     ["model.num_heads = 12", "divisible by parallel.tp = 8"]),
    (["model.num_query_groups=3"], 1, "gloo",
     ["model.num_query_groups = 3", "must divide model.num_heads = 4"]),
    (["parallel.tp=2", "model.num_query_groups=1"], 2, "gloo",
     ["model.num_query_groups = 1", "divisible by parallel.tp = 2"]),
    (["model.hidden_size=66"], 1, "gloo",
     ["model.hidden_size = 66", "divisible by model.num_heads = 4"]),
    (["parallel.tp=4", "model.ffn_hidden_size=130"], 4, "gloo",
     ["model.ffn_hidden_size = 130", "divisible by parallel.tp = 4"]),
    (["parallel.pp=2", "parallel.vpp=3"], 2, "gloo",
     ["model.num_layers = 4", "parallel.pp * parallel.vpp = 2 * 3 = 6"]),
    (["model.num_layers=3", "parallel.pp=2"], 2, "gloo",
     ["model.num_layers = 3", "parallel.pp * parallel.vpp = 2 * 1 = 2"]),
    (["parallel.vpp=2"], 1, "gloo", ["parallel.vpp = 2", "needs parallel.pp >= 2"]),
    (["train.global_batch_size=10"], 2, "gloo",
     ["train.global_batch_size = 10", "train.micro_batch_size * dp = 2 * 2 = 4"]),
    (["parallel.sequence_parallel=true"], 1, "gloo",
     ["parallel.sequence_parallel = true", "needs parallel.tp > 1"]),
    (["parallel.sequence_parallel=true", "parallel.tp=4", "model.seq_length=66"], 4, "gloo",
     ["model.seq_length = 66", "divisible by parallel.tp = 4", "sequence_parallel = true"]),
    (["model.window_size=0"], 1, "gloo", ["model.window_size = 0", "must be >= 1"]),
    (["optim.name=sgd"], 1, "gloo", ["optim.name = 'sgd'", "must be one of adam, lamb"]),
    (["model.params_dtype=bf16"], 1, "gloo",
     ["model.params_dtype = 'bf16'", "not on backend gloo", "'fp32'"]),
    (["model.params_dtype=fp16"], 1, "nccl", ["model.params_dtype = 'fp16'", "fp32, bf16"]),
    (["model.spec=tee"], 1, "gloo", ["model.spec = 'tee'", "must be one of auto, local, te"]),
    (["model.spec=te"], 1, "gloo", ["model.spec = 'te'", "needs CUDA", "'local'"]),
    (["train.device=cpu"], 1, "nccl", ["train.device = 'cpu'", "nccl needs CUDA"]),
    (["train.device=tpu"], 1, "gloo", ["train.device = 'tpu'", "auto, cpu, cuda"]),
    (["parallel.pp=2", "parallel.vpp=2", "overlap.pp=false"], 2, "gloo",
     ["parallel.batch_p2p_comm = true", "parallel.pp = 2", "parallel.vpp = 2", "same rank",
      "set parallel.batch_p2p_comm=false"]),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.batch_p2p_comm=true"], 2, "nccl",
     ["parallel.batch_p2p_comm = true", "overlap.pp needs individual", "overlap.pp=false"]),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "overlap.tp_chunks=3"], 2, "gloo",
     ["overlap.tp_chunks = 3", "per-rank sequence", "= 32", "overlap.tp=false"]),
    (["overlap.tp_chunks=0"], 1, "gloo", ["overlap.tp_chunks = 0", "must be >= 1"]),
    # interleaving: 6 / (micro 2 * dp 1) = 3 micro-batches per step, not divisible by pp = 2
    (["parallel.pp=2", "parallel.vpp=2", "parallel.batch_p2p_comm=false",
      "train.global_batch_size=6"], 2, "gloo",
     ["train.global_batch_size = 6", "parallel.vpp = 2", "number of micro-batches",
      "= 3 must be divisible by parallel.pp = 2"]),
    (["train.steps=0"], 1, "gloo", ["train.steps = 0", "must be >= 1"]),
    (["model.num_layers=0"], 1, "gloo", ["model.num_layers = 0", "must be >= 1"]),
    (["model.hidden_size=-64"], 1, "gloo", ["model.hidden_size = -64", "must be >= 1"]),
    (["model.vocab_size=0"], 1, "gloo", ["model.vocab_size = 0", "must be >= 1"]),
    (["model.seq_length=0"], 1, "gloo", ["model.seq_length = 0", "must be >= 1"]),
    (["train.micro_batch_size=0"], 1, "gloo", ["train.micro_batch_size = 0", "must be >= 1"]),
    (["parallel.tp=0"], 1, "gloo", ["parallel.tp = 0", "must be >= 1"]),
    (["parallel.dp=0"], 1, "gloo", ["parallel.dp = 0", "must be >= 1"]),
    (["optim.lr=0"], 1, "gloo", ["optim.lr = 0.0", "must be > 0"]),
    (["optim.lr=nan"], 1, "gloo", ["optim.lr = nan", "must be a finite number"]),
    (["optim.lr=inf"], 1, "gloo", ["optim.lr = inf", "must be a finite number"]),
    (["optim.eps=inf"], 1, "gloo", ["optim.eps = inf", "must be a finite number"]),
    (["optim.eps=2.0"], 1, "gloo", ["optim.eps = 2.0", "must be < 1"]),
    (["model.init_method_std=inf"], 1, "gloo", ["model.init_method_std = inf", "finite"]),
    (['data.path=""'], 1, "gloo", ["data.path = ''", "token file prefix"]),
    (["data.loader=disk"], 1, "gloo", ["data.loader = 'disk'", "one of node, rank"]),
    (["optim.min_lr=0.1", "optim.lr=0.01"], 1, "gloo", ["optim.min_lr = 0.1", "<= optim.lr = 0.01"]),
    (["optim.warmup_steps=5", "train.steps=5"], 1, "gloo", ["optim.warmup_steps = 5", "< train.steps = 5"]),
    (["optim.beta2=1.0"], 1, "gloo", ["optim.beta2 = 1.0", "in [0, 1)"]),
    (["optim.warmup_steps=-1"], 1, "gloo", ["optim.warmup_steps = -1", "must be >= 0"]),
    (["model.hidden_dropout=1.5"], 1, "gloo", ["model.hidden_dropout = 1.5", "in [0, 1)"]),
    (["checkpoint.keep=0"], 1, "gloo", ["checkpoint.keep = 0", "must be >= 1"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, world_size, backend, fragments",
    VALIDATION_CASES,
    ids=[" ".join(case[0]) for case in VALIDATION_CASES],
)
def test_validation_rules(overrides, world_size, backend, fragments):
    assert_mentions(refused(overrides, world_size, backend), *fragments)


def test_each_validation_case_is_otherwise_valid():
    """The base the cases start from validates, so each case fails for its own reason."""
    assert validate(load(), 1, "gloo").parallel.dp == 1
    assert validate(load(None, ["parallel.tp=2", "parallel.pp=2"]), 8, "gloo").parallel.dp == 2


def test_pp_overlap_makes_pp2_interleaving_unbatched_by_default():
    job = validate(load(None, ["parallel.pp=2", "parallel.vpp=2"]), 2, "gloo")
    assert job.parallel.effective_batch_p2p_comm(job.overlap) is False


def test_batch_p2p_comm_false_fixes_pp2_interleaving_on_gloo_and_nccl_allows_it():
    overrides = ["parallel.pp=2", "parallel.vpp=2", "overlap.pp=false"]
    assert validate(load(None, [*overrides, "parallel.batch_p2p_comm=false"]), 2, "gloo")
    assert validate(load(None, [*overrides, "train.device=cuda"]), 2, "nccl")  # distinct peers
    assert validate(load(None, ["parallel.pp=4", "parallel.vpp=1"]), 4, "gloo")


def test_interleaving_rule_only_applies_with_vpp():
    # 6 / (1 * 2) = 3 micro-batches: fine for plain 1F1B with pp = 2
    assert validate(load(None, ["parallel.pp=2", "train.global_batch_size=6"]), 2, "gloo")


def test_all_problems_are_reported_together():
    message = refused(["model.hidden_size=0", "optim.name=sgd"])
    assert_mentions(message, "model.hidden_size = 0", "optim.name = 'sgd'")
    assert "divisible" not in message  # range problems stop before the divisibility rules
    message = refused(["model.num_heads=3", "parallel.tp=2", "train.global_batch_size=6"], 4)
    assert_mentions(message, "model.num_heads = 3", "train.global_batch_size = 6")


def test_validate_arguments():
    with pytest.raises(ConfigError, match="backend = 'mpi'"):
        validate(load(), 1, "mpi")
    with pytest.raises(ConfigError, match="world_size = 0"):
        validate(load(), 0, "gloo")


# --- to_toml / to_dict ---------------------------------------------------------------------------


def test_to_toml_round_trips(tmp_path):
    cfg = validate(
        load(None, ["parallel.tp=2", "optim.name=lamb", "model.window_size=16", "optim.lr=3e-4"]),
        2,
        "gloo",
    )
    text = to_toml(cfg)
    assert "window_size = 16" in text
    assert load(write(tmp_path, text)) == cfg


def test_to_toml_omits_none_and_load_restores_it(tmp_path):
    cfg = load()
    assert cfg.model.window_size is None and cfg.data.path is None and cfg.parallel.dp is None
    text = to_toml(cfg)
    for key in ("window_size", "num_query_groups", "ffn_hidden_size", "path"):
        assert key not in text
    assert "dp" not in tomllib.loads(text)["parallel"]
    assert load(write(tmp_path, text)) == cfg


def test_every_optional_field_defaults_to_none():
    """What makes omitting None in to_toml lossless: an omitted key is exactly its None default."""
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(section.default_factory()):
            default = f.default
            assert (default is None) == ("None" in str(f.type)), f"{section.name}.{f.name}"


def test_to_dict():
    d = to_dict(load())
    assert d["model"]["hidden_size"] == 64
    assert d["model"]["window_size"] is None
    assert list(d) == [
        "parallel",
        "model",
        "optim",
        "train",
        "data",
        "checkpoint",
        "overlap",
        "diagnostics",
        "fault_tolerance",
        "metrics",
    ]


# --- presets ----------------------------------------------------------------------------------------

PRESET_WORLDS = {
    "tiny": (1, "gloo"),
    "h100-1b": (1, "nccl"),
    "megascale-175b": (12288, "nccl"),
    "llama-tiny": (1, "gloo"),
    "llama3-8b": (8, "nccl"),
}


def test_every_preset_is_covered():
    assert sorted(config.presets()) == sorted(PRESET_WORLDS)


@pytest.mark.parametrize("name", sorted(PRESET_WORLDS))
def test_preset_loads_validates_and_is_headed_by_its_hardware(name, tmp_path):
    world_size, backend = PRESET_WORLDS[name]
    cfg = validate(load(name), world_size, backend)
    head = (config.PRESETS_DIR / f"{name}.toml").read_text().splitlines()
    assert head[0].startswith("# Hardware: ")
    assert any(line.startswith("# Demonstrates: ") for line in head[:5])
    assert load(write(tmp_path, to_toml(cfg))) == cfg


def test_tiny_preset_also_runs_as_8_cpu_ranks():
    overrides = [
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.batch_p2p_comm=false",
    ]
    assert validate(load("tiny", overrides), 8, "gloo").parallel.dp == 2


def test_megascale_175b_preset_matches_the_paper():
    cfg = validate(load("megascale-175b"), 12288, "nccl")
    p, m, t = cfg.parallel, cfg.model, cfg.train
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length) == (96, 12288, 96, 2048)
    assert (p.tp, p.pp, p.dp) == (8, 8, 192)
    assert p.sequence_parallel and m.parallel_block and cfg.optim.name == "lamb"
    tokens_per_step = t.global_batch_size * m.seq_length
    assert abs(tokens_per_step / 6.34 - 1.984e6) / 1.984e6 < 0.001  # 1.984M tokens/s at 6.34 s/it
    params = m.num_layers * 12 * m.hidden_size**2
    assert 170e9 < params < 180e9


def test_h100_preset_is_about_1b_params():
    m = load("h100-1b").model
    params = m.num_layers * 12 * m.hidden_size**2 + m.vocab_size * m.hidden_size
    assert 0.9e9 < params < 1.2e9


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.normalization=rmsnorm"], "model.normalization = 'rmsnorm': must be one of"),
        (["train.recompute=all"], "train.recompute = 'all': must be one of none, selective, full"),
        (["train.recompute_method=even"], "train.recompute_method = 'even': must be one of"),
        (["model.rotary_base=0"], "model.rotary_base = 0: must be a positive integer"),
        (
            ["train.recompute=full", "train.recompute_num_layers=5"],
            "train.recompute_num_layers = 5: must be 1 to 4",
        ),
        (
            ["train.recompute=full", "train.recompute_num_layers=3"],
            "train.recompute_num_layers = 3: must divide the 4 layers",
        ),
    ],
)
def test_model_options_and_recomputation_are_checked_in_one_line(sets, message):
    with pytest.raises(ConfigError) as err:
        validate(load("tiny", sets), 1, "gloo")
    assert message in str(err.value) and "\n" not in str(err.value)


PROFILE_STEPS_RULE = "must be [first, last] with 1 <= first <= last <= train.steps = 50"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.profile_steps=[3]"], f"train.profile_steps = [3]: {PROFILE_STEPS_RULE}"),
        (["train.profile_steps=[1, 2, 3]"], "train.profile_steps = [1, 2, 3]: must be [first, "),
        (["train.profile_steps=[0, 2]"], f"train.profile_steps = [0, 2]: {PROFILE_STEPS_RULE}"),
        (["train.profile_steps=[4, 3]"], f"train.profile_steps = [4, 3]: {PROFILE_STEPS_RULE}"),
        (["train.profile_steps=[49, 51]"], "train.profile_steps = [49, 51]: must be [first, "),
        (["train.memory_history=true"], "train.memory_history = true: needs train.device = 'cuda'"),
    ],
)
def test_profiling_options_are_checked_in_one_line(sets, message):
    with pytest.raises(ConfigError) as err:
        validate(load("tiny", sets), 1, "gloo")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_profiling_options_that_are_accepted(tmp_path):
    assert load("tiny").train.profile_steps == [] and not load("tiny").train.memory_history
    for window in ("[]", "[1, 1]", "[2, 50]"):
        validate(load("tiny", [f"train.profile_steps={window}"]), 1, "gloo")
    # "auto" may find a GPU where the job runs; on CPU the run skips the history with a warning
    validate(load("tiny", ["train.device=auto", "train.memory_history=true"]), 1, "gloo")
    job = load("tiny", ["train.profile_steps=[2, 3]"])
    assert load(write(tmp_path, to_toml(job))).train.profile_steps == [2, 3]


def test_llama_options_reach_megatron_cores_config():
    from megascale.model.gpt import transformer_config

    job = load("llama-tiny")
    tconf = transformer_config(job, "cpu")
    assert (tconf.normalization, tconf.add_bias_linear, tconf.gated_linear_unit) == (
        "RMSNorm",
        False,
        True,
    )
    assert (tconf.recompute_granularity, tconf.recompute_method, tconf.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    assert transformer_config(load("tiny"), "cpu").recompute_granularity is None

"""The app config: bundled YAML files, overrides, validation, and Ray's own Serve schema."""

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from spin_cluster.deployments.app import IMPORT_PATH, build_app, deploy_config
from spin_cluster.deployments.settings import CONFIG_DIR, AppConfig, load_app_config, rank_bundles
from spin_cluster.sparse.budget import budget_tokens

BUNDLED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_bundled_configs_exist():
    assert {"default", "spin", "spin-quest"} <= set(BUNDLED)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_config_loads_and_builds_an_application(name):
    cfg = load_app_config({"config": name})
    assert isinstance(cfg, AppConfig)
    assert isinstance(build_app({"config": name}), Application)


def test_spin_quest_config_turns_on_the_offloaded_cache():
    cfg = load_app_config({"config": "spin-quest"})
    assert cfg.spin.cache.kind == "offloaded" and cfg.spin.sparse.algorithm == "quest"


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_serve_the_models_own_context(name, smollm2_path):
    cfg = load_app_config({"config": name, "model": {"path": smollm2_path}})
    assert cfg.spin.model.max_model_len is None
    assert cfg.with_model_context().spin.model.max_model_len == 8192  # SmolLM2's max_position_embeddings
    mine = load_app_config({"config": name, "model": {"path": smollm2_path, "max_model_len": 1024}})
    assert mine.with_model_context() is mine  # a length that is set stays


def test_spin_config_selects_by_labels_at_a_16th_of_the_context_and_2048_tokens_at_least():
    cfg = load_app_config({"config": "spin"})
    sparse = cfg.spin.sparse
    assert cfg.spin.cache.kind == "offloaded" and sparse.algorithm == "labels" and sparse.budget == 1 / 16
    assert sparse.budget_floor_tokens == 2048 and sparse.resident_margin == 0.5
    assert sparse.options["index_dtype"] == "float8_e4m3fn"  # labels in e4m3: docs/accuracy.md
    assert [budget_tokens(sparse, n) for n in (2048, 8192, 65536)] == [2048, 2048, 4096]


def test_overrides_replace_single_keys_of_a_section():
    cfg = load_app_config({"config": "default", "model": {"path": "/models/x"}, "serve": {"max_waiting_requests": 3}})
    assert cfg.spin.model.path == "/models/x"
    assert cfg.spin.model.max_model_len is None  # kept from the file: the model's own context
    assert cfg.serve.max_waiting_requests == 3
    assert cfg.model_name == "x"


def test_a_yaml_file_path_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"serve": {"model_name": "mine"}}))
    assert load_app_config({"config": str(path)}).model_name == "mine"


@pytest.mark.parametrize("bad, words", [
    ({"serve": {"max_body_bytes": 10}}, "max_body_bytes"),
    ({"serve": {"no_such_key": 1}}, "no_such_key"),
    ({"serve": {"engine_stale_s": 0.1, "stats_interval_s": 0.5}}, "engine_stale_s"),
    ({"scheduler": {"max_num_seqs": 0}}, "max_num_seqs"),
    ({"serve": {"engine_resources": {"engine_node": -1}}}, "engine_resources"),
    ({"serve": {"engine_resources": ["engine_node"]}}, "engine_resources"),
    ({"config": "no-such-config"}, "no-such-config"),
])
def test_bad_settings_say_what_to_change(bad, words):
    with pytest.raises(ValueError, match=words):
        load_app_config(bad)


@pytest.mark.parametrize("name", BUNDLED)
def test_generated_serve_config_passes_rays_schema(name):
    args = {"config": name, **yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())}
    serve_cfg = deploy_config(args, port=8000)
    schema = ServeDeploySchema.model_validate(serve_cfg)
    app = schema.applications[0]
    assert isinstance(app, ServeApplicationSchema)
    assert app.import_path == IMPORT_PATH and app.args == args
    assert isinstance(build_app(app.args), Application)  # what Serve calls with those args


@pytest.mark.parametrize("bad, words", [
    ({"serve": {"engine_ranks": 0}}, r"^serve.engine_ranks=0: must be >= 1$"),
    ({"serve": {"engine_ranks": 1.5}}, r"^serve.engine_ranks=1.5: use an integer$"),
    ({"serve": {"engine_ranks": 4, "engine_num_gpus": 2}}, "exceeds serve.engine_num_gpus=2: each head-parallel rank"),
    ({"config": "spin-quest", "sparse": {"options": {"top_p": 0.9}}, "serve": {"engine_ranks": 2}},
     r"engine_ranks=2: .*leave sparse.options.top_p out"),
    ({"sparse": {"prefill": {"algorithm": "block"}}, "serve": {"engine_ranks": 2}},
     "set sparse.prefill.algorithm=dense"),
])
def test_bad_engine_ranks_say_what_to_change(bad, words):
    with pytest.raises(ValueError, match=words):
        load_app_config(bad)


@pytest.mark.parametrize("threads", [0, 1.5, True, "2", "most"])
def test_bad_engine_torch_threads_are_refused(threads):
    with pytest.raises(ValueError, match=f"serve.engine_torch_threads={threads!r}: use an integer >= 1, \"all\""):
        load_app_config({"serve": {"engine_torch_threads": threads}})


def test_a_cpu_engine_prefills_on_every_core_and_decodes_on_one_by_default():
    import os

    from spin_cluster.deployments.settings import AUTO_THREADS_MIN_TOKENS, ServeOptions

    cores = len(os.sched_getaffinity(0))
    for serve in (load_app_config({}).serve, ServeOptions()):  # default.yaml and the built-in default: "auto"
        assert serve.engine_torch_threads == "auto"
        assert serve.torch_threads() == cores  # what the engine is built with
        policy = serve.step_threads()
        assert (policy.small, policy.large, policy.min_tokens) == (1, cores, AUTO_THREADS_MIN_TOKENS)
    gpu = load_app_config({"serve": {"engine_num_gpus": 1}}).serve
    assert gpu.torch_threads() is None and gpu.step_threads() is None  # a GPU engine: Ray's


@pytest.mark.parametrize(("threads", "expected"), [("all", "cores"), (3, 3), (None, None)])
def test_other_thread_settings_fix_one_count_for_every_step(threads, expected):
    import os

    serve = load_app_config({"serve": {"engine_torch_threads": threads}}).serve
    assert serve.torch_threads() == (len(os.sched_getaffinity(0)) if expected == "cores" else expected)
    assert serve.step_threads() is None


@pytest.mark.parametrize("args, num_kv_heads, ranks", [
    ({}, None, 1),  # the default: no GPU, the plain engine
    ({"serve": {"engine_num_gpus": 4}}, None, 4),  # one rank per GPU
    ({"serve": {"engine_num_gpus": 8}}, 3, 3),  # ... at most one per KV head
    ({"serve": {"engine_num_gpus": 0.5}}, None, 1),
    ({"serve": {"engine_num_gpus": 4, "engine_ranks": 2}}, None, 2),
    ({"serve": {"engine_ranks": 2}}, 3, 2),  # CPU processes
    ({"serve": {"engine_ranks": 1, "engine_num_gpus": 8}}, None, 1),
    ({"config": "spin-quest", "serve": {"engine_num_gpus": 8}}, 3, 3),  # Spin's cache runs head-parallel too
    ({"config": "spin-quest", "sparse": {"algorithm": "seer"}, "serve": {"engine_num_gpus": 8}}, 3, 1),  # seer: one
])
def test_ranks_per_engine(args, num_kv_heads, ranks):
    assert load_app_config(args).ranks_per_engine(num_kv_heads) == ranks


@pytest.mark.parametrize("bad, words", [
    ({"model": {"max_model_len": 8448}}, r"max_model_len=8448 exceeds the model's context of 8192 tokens .*model.hf_overrides"),
    ({"scheduler": {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}},
     r"max_num_batched_tokens \(512\) must be >= max_model_len \(8192\)"),
    ({"sparse": {"algorithm": "quest", "options": {"per_head_budgets": [[64] * 2] * 30}}},
     r"sparse.options.per_head_budgets must be \[30\]\[3\]"),
    ({"serve": {"engine_ranks": 4}}, "serve.engine_ranks=4 exceeds the model's num_key_value_heads=3"),
    ({"model": {"device": "cuda"}}, "serve.engine_num_gpus=0, so Ray gives an engine no GPU"),
])
def test_settings_the_model_cannot_run_say_what_to_change(smollm2_path, bad, words):
    config = load_app_config({"config": "default", **bad, "model": {"path": smollm2_path, **bad.get("model", {})}})
    with pytest.raises(ValueError, match=words):
        config.check_model()
    with pytest.raises(ValueError, match=words):
        build_app(config)


def test_bundled_configs_fit_the_default_model(smollm2_path):
    for name in BUNDLED:
        load_app_config({"config": name, "model": {"path": smollm2_path}}).check_model()


def test_rank_bundles_give_each_rank_its_cpus_and_gpu_and_rank_0_the_custom_resources():
    assert rank_bundles(3, gpu=True, num_cpus=2, resources={"engine_node": 1}) == [
        {"CPU": 2.0, "GPU": 1.0, "engine_node": 1}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert rank_bundles(2, gpu=False) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_every_serve_field_says_what_it_is():
    from spin_cluster.deployments.settings import ServeOptions

    for section in (AppConfig, ServeOptions):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"

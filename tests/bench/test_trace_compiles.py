"""benchmarks/trace_compiles.py: its JIT hook names a compile and what changed in its
specialisation, and its step wrapper reports the compiles a step waited on."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_compiles.py"


def _compile(hook, layer_spec: str, warps: int):
    fn = SimpleNamespace(jit_function=SimpleNamespace(
        params=[SimpleNamespace(name="x_ptr"), SimpleNamespace(name="layer")]))
    key = ((("*bf16", "D"), ("i32", layer_spec)), f"num_warps={warps}, num_stages=3")
    return hook(key=key, repr="_kern[num_warps=4](x_ptr: ...)", fn=fn, compile={}, is_manual_warmup=False,
                already_compiled=False)


def test_a_compile_is_named_with_what_changed_and_charged_to_its_step(monkeypatch, capsys):
    from triton import knobs

    from spin_cluster.engine import Engine

    in_step = []  # what the (stand-in) engine step does: compile a kernel, or not

    def fake_step(self):
        for spec in in_step:
            _compile(knobs.runtime.jit_cache_hook, spec, 4)
        return ["out"]

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(Engine, "step", fake_step)
    monkeypatch.setenv("SPIN_SLOW_STEP_S", "100")
    spec = importlib.util.spec_from_file_location("trace_compiles", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._install()
    hook = knobs.runtime.jit_cache_hook

    assert _compile(hook, "D", 4) is False  # the hook never stops a compile
    assert "compile _kern: first" in capsys.readouterr().err
    _compile(hook, "", 8)
    err = capsys.readouterr().err
    assert "'layer'" in err and "('i32', 'D') -> ('i32', '')" in err and "['num_warps=4'] -> ['num_warps=8']" in err

    assert Engine.step(object()) == ["out"]  # no compile, not slow: nothing said
    assert "step" not in capsys.readouterr().err
    in_step.append("1")
    assert Engine.step(object()) == ["out"]
    err = capsys.readouterr().err
    assert "('i32', '') -> ('i32', '1')" in err and "step 2:" in err and "1 compiles ['_kern']" in err

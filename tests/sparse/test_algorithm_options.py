"""sparse.options are typed per algorithm (spin_cluster.algorithm_options) and checked when
the config is read: the table names every algorithm of the registry, each model's options are
exactly what its class's constructor takes from a user (besides the system's own, top_p,
resident_margin and per_head_budgets, which the algorithms that score pages take), and an
unknown or ill-typed option is one error line naming it."""

import inspect

import pytest

from spin_cluster.algorithm_options import OPTIONS, SELECT_OPTIONS, ScoredOptions
from spin_cluster.config import SpinConfig
from spin_cluster.sparse import ALGORITHM_MODULES, get_algorithm

# Constructor keywords the cache builder gives, never a user: the model's folder, the index's
# pages and layers, a device buffer's dtype.
BUILDER_GIVEN = {"model_path", "index_pages", "model_layers", "buffer_dtype"}


def constructor_options(cls) -> set[str]:
    """Keywords with defaults down the constructors that pass ``**kw`` on."""
    found: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        found |= {p.name for p in params if p.default is not inspect.Parameter.empty}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return found - BUILDER_GIVEN


def test_the_table_names_every_algorithm_of_the_registry():
    assert set(OPTIONS) == set(ALGORITHM_MODULES)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_model_takes_what_its_constructor_takes(name):
    assert set(OPTIONS[name].model_fields) - SELECT_OPTIONS == constructor_options(get_algorithm(name))


def test_top_p_is_an_option_of_the_algorithms_that_score_pages():
    scored = {name for name, model in OPTIONS.items() if issubclass(model, ScoredOptions)}
    assert scored == set(OPTIONS) - {"dense", "streaming"}  # every page; sink and window only
    assert SELECT_OPTIONS == {"top_p", "resident_margin", "per_head_budgets"}


def _config(options):
    return SpinConfig.from_dict({"cache": {"kind": "offloaded"},
                                 "sparse": {"algorithm": "quest", "budget": 64, "options": options}})


def test_options_are_checked_when_the_config_is_read():
    assert _config({"summary": "moments", "index_dtype": "bfloat16"}).sparse.options["summary"] == "moments"
    with pytest.raises(ValueError, match=r"^sparse.options: 'quest' takes no option 'summry'; its options: "
                                         r"coarse_factor, .*summary, top_p$"):
        _config({"summry": "moments"})
    with pytest.raises(ValueError, match=r"^sparse.options.summary='mean': choose one of 'bounds' or 'moments'$"):
        _config({"summary": "mean"})
    with pytest.raises(ValueError, match=r"^sparse.options.moments_z=-1: "):
        _config({"moments_z": -1})


def test_select_options_are_read_from_the_options_and_round_trip():
    cfg = _config({"top_p": 0.9, "resident_margin": 0.5, "summary": "moments", "per_head_budgets": [[8, 4.0]]})
    assert (cfg.sparse.top_p, cfg.sparse.resident_margin, cfg.sparse.per_head_budgets) == (0.9, 0.5, ((8, 4),))
    assert cfg.sparse.options == {"top_p": 0.9, "resident_margin": 0.5, "summary": "moments",
                                  "per_head_budgets": [[8, 4.0]]}
    assert SpinConfig.from_dict(cfg.to_dict()) == cfg
    none = _config(None).sparse
    assert (none.top_p, none.resident_margin, none.per_head_budgets) == (None, 0.0, None)

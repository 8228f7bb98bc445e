"""spin_cluster.bench.args: the shared flags keep their defaults, and --out goes through the
provenance helper."""

import argparse
import json

from spin_cluster.bench.args import add_algorithm, add_out, add_out_folder, add_shape, save


def test_save_writes_the_result_with_its_provenance_and_only_with_out(tmp_path):
    ap = argparse.ArgumentParser()
    add_out(ap, md=True)
    path = tmp_path / "topic" / "r.json"
    save(ap.parse_args(["--out", str(path)]), {"us": 1.5})
    saved = json.loads(path.read_text())
    assert saved["us"] == 1.5 and set(saved["provenance"]) >= {"commit", "command", "gpu", "date"}
    args = ap.parse_args([])
    assert (args.out, args.md) == (None, None)
    save(args, {"us": 2.0})  # nothing to write to
    assert [p.name for p in tmp_path.rglob("*.json")] == ["r.json"]


def test_groups_keep_the_scripts_defaults():
    ap = argparse.ArgumentParser()
    add_shape(ap, page_size=16, layers=True)
    add_algorithm(ap)
    add_out_folder(ap)
    a = ap.parse_args([])
    assert (a.layers, a.heads, a.kv_heads, a.head_dim, a.page_size) == (32, 32, 8, 128, 16)
    assert (a.algorithm, a.out) == ("quest", ".")

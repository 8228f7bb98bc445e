"""Built-in sparse algorithms, one file each; importing registers them."""

from spin_cluster.sparse import dense, labels, oracle, quest, retroinfer, seer, shadowkv, sparq, streaming  # noqa: F401

from spin_cluster.engine.engine import Engine
from spin_cluster.engine.request import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]

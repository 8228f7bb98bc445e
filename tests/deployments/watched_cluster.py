"""A one-machine Ray cluster with its dashboard on 127.0.0.1, for ``test_deploy_watch``: two Serve
apps, ``fine`` (runs) and ``spin`` (its replica's constructor fails, so Serve gives up after
``START_ATTEMPTS``), then it waits until it is stopped.

    python watched_cluster.py DASHBOARD_PORT HTTP_PORT REASON    # REASON: the constructor's error
"""

import os
import sys
import time

from spin_cluster.deployments.settings import START_ATTEMPTS

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep the loopback node address (local.py says why)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import ray  # noqa: E402  (reads the environment above)
from ray import serve  # noqa: E402


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Fine:
    def __call__(self, request):
        return "ok"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_constructor_retry_count=START_ATTEMPTS)
class EngineServer:
    def __init__(self, reason: str):
        raise ValueError(reason)


def main(dashboard_port: int, http_port: int, reason: str) -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=dashboard_port, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(Fine.bind(), name="fine", route_prefix="/fine")
    try:
        serve.run(EngineServer.bind(reason), name="spin", route_prefix="/spin")
    except RuntimeError:  # DEPLOY_FAILED, as intended
        pass
    print("deployed", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

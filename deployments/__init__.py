"""The Ray Serve shell around the engine (``spin_cluster.deployments``).

    app.py            build_app(config): ingress + planner + engines, from one config
    settings.py       the app config: SpinConfig sections plus a ``serve`` section
    ingress.py        OpenAIIngress: the OpenAI HTTP API, /health, /metrics
    planner.py        ClusterPlanner: engine plans, routing by free KV, cluster stats
    routing.py        the request router that follows the planner's pick
    engine_server.py  EngineServer: one per node, relays one Engine's outputs
    engine_loop.py    the thread that owns that Engine
    engine_stats.py   engine stats -> the planner's report
    metrics.py        Prometheus registry of the app
    openai_protocol.py, errors.py, messages.py: request/response models, error bodies, messages
    local.py          local mode (``spin-cluster serve``)

Nothing here is imported by ``spin_cluster`` itself; importing this package alone does not
import Ray.
"""

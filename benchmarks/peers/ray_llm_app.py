"""Ray Serve LLM serving a model directory on the CPU, with vLLM's CPU build as its engine; runs
until SIGTERM, then shuts Serve and its Ray instance down. The same-framework peer of
`make bench-peers` (optional: `make peers-ray-llm` installs ray[serve] into .venv-peers).

    .venv-peers/bin/python -P benchmarks/peers/ray_llm_app.py --model DIR --port PORT

Settings as checked on these machines: `accelerator_config={"kind": "cpu"}` (else it waits for a
GPU bundle), an ingress asking for 0 CPUs (the model server's bundle takes both cores), fp32, a
2048-token context and 4 GiB of KV cache, as `vllm serve` gets. Imports only the standard library,
Ray and vLLM (run with `-P`, like `vllm_cli.py`).
"""

import argparse
import signal
import threading

HOST = "127.0.0.1"
MODEL = "qwen3-tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(address="local", include_dashboard=False)
    try:
        serve.start(http_options={"host": HOST, "port": args.port})
        config = LLMConfig(
            model_loading_config={"model_id": MODEL, "model_source": args.model},
            accelerator_config={"kind": "cpu"},
            engine_kwargs={"dtype": "float32", "max_model_len": 2048},
            deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
            runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "4"}},
        )
        ingress = {"ray_actor_options": {"num_cpus": 0}}
        app = build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})
        serve.run(app, blocking=False)
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

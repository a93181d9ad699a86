"""Deployment configuration: config.yaml, the light config and the KubeRay manifests validate against Ray Serve's
own schema and SmartSpec's AppConfig, and the RayService carries the same application as config.yaml."""
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from deployments.app import llm_server_options  # noqa: E402
from deployments.control.config import AppConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

PROXY_GUARD = "deployments.http.proxy_guard:middlewares"


def _serve_config(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    if doc.get("kind") == "RayService":
        assert doc["apiVersion"] == "ray.io/v1"
        return yaml.safe_load(doc["spec"]["serveConfigV2"])
    return doc


@pytest.mark.parametrize("path", ["config.yaml", "config-light.yaml", "config-gpu.yaml", "cluster/rayservice.yaml",
                                  "cluster/rayservice-gpu.yaml"])
def test_serve_config_validates_against_ray_serve_schema(path):
    config = _serve_config(ROOT / path)
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    AppConfig.model_validate(app.args)  # and SmartSpec's own checks of every option


def test_rayservice_serves_the_same_application_as_config_yaml():
    local = _serve_config(ROOT / "config.yaml")["applications"][0]
    k8s = _serve_config(ROOT / "cluster/rayservice.yaml")["applications"][0]
    assert k8s == local


def test_rayservice_cluster_shape():
    for path, resource in (("cluster/rayservice.yaml", "cpu"), ("cluster/rayservice-gpu.yaml", "nvidia.com/gpu")):
        doc = yaml.safe_load((ROOT / path).read_text())
        cluster = doc["spec"]["rayClusterConfig"]
        assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
        (group,) = cluster["workerGroupSpecs"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert resource in limits and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_no_manifest_opens_the_ray_dashboard_and_each_takes_the_api_key_from_a_secret():
    """The Ray dashboard takes jobs: a manifest binds it to the head's localhost (ray-cluster.yaml) or puts it
    behind Ray's token (RayService: KubeRay's authOptions, and no pod that turns Ray's auth off). Every RayService
    pod reads SMARTSPEC_API_KEY from the Secret, never from a literal, and every node's proxy runs the proxy guard."""
    launcher = (ROOT / "cluster/ray-cluster.yaml").read_text()
    heads = [line for line in launcher.splitlines() if "ray start --head" in line]
    assert heads and all("--dashboard-host=127.0.0.1" in line for line in heads)
    for path in ("cluster/rayservice.yaml", "cluster/rayservice-gpu.yaml"):
        cluster = yaml.safe_load((ROOT / path).read_text())["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token"}, path
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for group in groups:
            env = {e["name"]: e for c in group["template"]["spec"]["containers"] for e in c.get("env", [])}
            assert "RAY_AUTH_MODE" not in env, path  # KubeRay sets it (token) with authOptions
            assert env["SMARTSPEC_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "smartspec-api-key", path
            assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]["value"] == PROXY_GUARD, path
    assert all(PROXY_GUARD in line for line in launcher.splitlines() if "ray start --" in line)


def test_default_config_is_the_default_pair():
    """The default pair under the goodput policy, which chooses per request the draft model or suffix speculation
    (docs/benchmarks.md, "One user against llama.cpp")."""
    args = AppConfig.model_validate(_serve_config(ROOT / "config.yaml")["applications"][0]["args"])
    assert (args.model, args.speculation.method, args.speculation.model, args.speculation.policy) == (
        "qwen2.5-coder-1.5b", ["draft_model", "suffix"], "qwen2.5-coder-0.5b", "smartspec")
    assert yaml.safe_load((ROOT / "config.yaml").read_text())["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_placement_group_holds_replica_draft_and_tp_workers():
    cfg = AppConfig.model_validate({"model": "m", "tensor_parallel_size": 2, "replica_num_cpus": 0.5,
                                    "speculation": {"model": "d", "draft_num_cpus": 0.25}, "tp_num_cpus": 1})
    opts = llm_server_options(cfg)
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 1}, {"CPU": 1}]
    auto = llm_server_options(AppConfig.model_validate({"model": "m", "autoscaling": {"max_replicas": 3}}))
    assert auto["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in auto


@pytest.mark.parametrize("args, message", [
    ({"speculation": {"method": "draft_model", "model": None}}, "needs speculation.model"),
    ({"speculation": {"draft_num_cpus": 0}}, "draft_num_cpus must be a number > 0"),
    ({"speculation": {"k": 3}}, "unknown speculative_config keys"),
    ({"speculation": {"policy": "sometimes"}}, "unknown policy"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"kv_cache": 1}, "Extra inputs are not permitted"),
    ({"speculation": {"method": "ngram", "tree": {"max_nodes": 99}}}, "tree.max_nodes must be at most 63"),
    ({"step_trace_dir": "traces"}, "step_trace_dir must be an absolute path"),
    ({"quantization": "awq"}, "quantization"),
    ({"dtype": "float8"}, "dtype"),
])
def test_bad_app_config_is_refused_with_the_reason(args, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.model_validate(args)


def test_quantization_reaches_the_engine():
    assert AppConfig.model_validate({"model": "m", "quantization": "gguf"}).engine_config().quantization == "gguf"
    assert AppConfig.model_validate({"model": "m"}).engine_config().quantization == "auto"
    assert AppConfig.model_validate({"model": "m", "quantization": None}).engine_config().quantization is None
    assert AppConfig.model_validate({"model": "m", "tensor_parallel_size": 2}).tensor_parallel_size == 2


def test_dtype_reaches_the_engine():
    """A served GPU replica runs bf16 unless told otherwise; the CPU stays fp32."""
    assert AppConfig.model_validate({"model": "m", "device": "cuda"}).engine_config().dtype == "bfloat16"
    assert AppConfig.model_validate({"model": "m"}).engine_config().dtype == "float32"
    assert AppConfig.model_validate({"model": "m", "device": "cuda", "dtype": "float16"}).engine_config().dtype \
        == "float16"


def test_each_replica_traces_its_steps_to_a_folder_of_its_own(tmp_path):
    cfg = AppConfig.model_validate({"model": "m", "step_trace_dir": str(tmp_path)})
    assert cfg.engine_config("r1").trace_path == str(tmp_path / "r1")
    assert AppConfig.model_validate({"model": "m"}).engine_config("r1").trace_path is None

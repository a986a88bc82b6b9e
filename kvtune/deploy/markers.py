"""Markers kvtune writes into a rendered file so that `kvtune check` can read the values back.

The writer (kvtune.deploy.render) and the reader (kvtune.deploy.read) both import them from here:
neither depends on the other.
"""

# Around the Lua table of limits in a rendered nginx.conf.
NGINX_CONFIG_BEGIN = "-- kvtune:config begin"
NGINX_CONFIG_END = "-- kvtune:config end"

# Kubernetes manifests (kvtune.deploy.k8s renders them, kvtune.deploy.k8s_read reads them back):
# the ConfigMap's key holding gateway.yaml, and the resource a vLLM container asks GPUs by.
K8S_FOLDER = "k8s"  # under recommend --out's folder
K8S_GATEWAY_FILE = f"{K8S_FOLDER}/gateway.yaml"
K8S_GATEWAY_CONFIG_KEY = "gateway.yaml"
K8S_GPU_RESOURCE = "nvidia.com/gpu"

"""From a recommendation to files that deploy, and back.

    render   the recommendation as vllm-serve.sh, gateway.yaml, nginx.conf, reports
    read     deployed files parsed back (a vllm serve command, gateway.yaml, nginx.conf)
    check    deployed files judged against the traffic (the CI gate)
"""

# Sourced by cluster-onprem.yaml's start commands on every node, before `ray stop` and `ray start`.

# The Python environment that setup_commands linked: `ray`, and the `python` the jobs run.
export PATH="$HOME/ray-cv/env/bin:$PATH"

# The address this node was reached at over SSH (by `ray up` for the head, by the head for a
# worker), which is its head_ip or worker_ips entry: SSH_CONNECTION is "client_ip client_port
# server_ip server_port". Given to `ray start`, or Ray picks the default route's interface.
# shellcheck disable=SC2086
set -- $SSH_CONNECTION
export RAY_CV_NODE_IP="$3"

# Ray's object store and workers want many files open: as many as this machine allows.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

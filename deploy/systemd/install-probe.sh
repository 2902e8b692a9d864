#!/bin/bash
# gpu-autorepair node probe, installed from the package at first boot. Paste this file into the GPU instances'
# launch template user data: cloud-init runs it as root, once per instance, after the network is up. On an ECS
# GPU-optimized AMI (Amazon Linux 2023) or Ubuntu. With user data of your own (`echo ECS_CLUSTER=... >>
# /etc/ecs/ecs.config`), append this after it without its first line, or give it as a second part of a MIME
# multi-part user data.
#
# It installs Python 3.11+ with its venv module where missing (dnf or apt-get), creates /opt/gpu-autorepair with
# `python3 -m venv`, installs 'gpu-autorepair[probe]' at the version below into it (the probe alone: no Temporal
# SDK), writes /etc/autorepair/autorepair.env, installs autorepair-probe.service (the same as
# deploy/systemd/autorepair-probe.service), and enables and starts it. Safe to run again: to change a setting,
# or to move every host of a new launch template version to another version.
#
# The probe proves which instance it runs on with the instance profile's credentials (from IMDS): the instance needs
# an instance profile (any role; the proof needs no permission) in an account the ingest allows, and IMDSv2. It
# makes no AWS call itself. The host needs HTTPS to the ingest, and to PyPI (or the index below) while this runs.
set -euo pipefail

# ---- Settings: edit these, nothing below. ----
# The package version, pinned: every host of one launch template version runs the same probe.
AUTOREPAIR_VERSION="0.2.0"
# The ingest the probe reports to: https, with the name its certificate carries.
INGEST_URL="https://ingest.autorepair.internal:8480"
# This host's capacity group. Empty: the instance's own gpu-autorepair:group tag, read from the instance metadata
# (the launch template must allow tags there: MetadataOptions InstanceMetadataTags=enabled).
GROUP=""
# The region of the ingest's ingest.sts_endpoint: the probe signs its proof for that endpoint.
STS_REGION="us-east-1"
# The kernel log source and any other `autorepair probe` flag: --kmsg, or --journald where only the journal keeps
# the kernel log; --policy nvidia-catalog; --heartbeat-interval SECONDS (the group's heartbeat_interval).
PROBE_ARGS="--kmsg"
# The PEM of a private CA that signed the ingest's certificate. Empty: the system's trust store decides.
INGEST_CA_PEM=""
# A package index instead of PyPI (a mirror, or a private index): e.g. https://pypi.example.internal/simple
INDEX_URL=""
# The group that may open the container runtime's socket (docker's: root:docker 0660). Where the host has it, the probe
# joins it (a drop-in beside the unit), so that its CONTAINER_RUNTIME check asks dockerd itself whether it answers,
# not only systemd whether its unit is active. Membership of the docker group lets a process run any container, so
# it is as good as root: empty leaves the probe out of it, and docker is judged by its unit alone.
RUNTIME_SOCKET_GROUP="docker"
# ----------------------------------------------

PREFIX=/opt/gpu-autorepair
CONF_DIR=/etc/autorepair
ENV_FILE="$CONF_DIR/autorepair.env"
CA_FILE="$CONF_DIR/ingest-ca.pem"
UNIT_FILE=/etc/systemd/system/autorepair-probe.service
IMDS=http://169.254.169.254/latest

log() { echo "install-probe: $*"; }
fail() {
    echo "install-probe: $*" >&2
    exit 1
}

# A value for the environment file: one line, none of the characters systemd would read otherwise.
check_value() {
    case "$2" in
        "" | *[[:space:]]* | *\"* | *\'* | *\\* | *\$*) fail "$1 '$2': empty, or holds a space, a quote, a backslash or a \$" ;;
    esac
}

imds() {
    local token
    token=$(curl -fsS --retry 5 --retry-connrefused -X PUT "$IMDS/api/token" \
        -H "X-aws-ec2-metadata-token-ttl-seconds: 60")
    curl -fsS --retry 5 -H "X-aws-ec2-metadata-token: $token" "$IMDS/meta-data/$1"
}

# Python 3.11 or later, with venv and ensurepip (Debian and Ubuntu ship those as a package of their own).
python_ok() {
    "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

find_python() {
    local candidate
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && python_ok "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

install_python() {
    if command -v dnf >/dev/null; then
        # Amazon Linux 2023: python3 is 3.9; 3.11 is a package of its own.
        dnf install -y -q python3.11 python3.11-pip
    elif command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
            apt-get install -y -q python3-venv # Ubuntu 24.04: python3 is 3.12
        else
            apt-get install -y -q python3.11 python3.11-venv # Ubuntu 22.04
        fi
    else
        # Amazon Linux 2 (yum) has no Python 3.11 package: use the AL2023 ECS GPU-optimized AMI.
        fail "no dnf or apt-get here: install Python 3.11 or later with its venv module, then run this again"
    fi
}

if [[ "$(id -u)" != 0 ]]; then
    fail "run as root (cloud-init runs user data as root)"
fi
case "$INGEST_URL" in
    https://?*) ;;
    *) fail "INGEST_URL '$INGEST_URL' is not an https:// URL" ;;
esac
check_value INGEST_URL "$INGEST_URL"
check_value STS_REGION "$STS_REGION"
[[ -z "$RUNTIME_SOCKET_GROUP" ]] || check_value RUNTIME_SOCKET_GROUP "$RUNTIME_SOCKET_GROUP"
if [[ -z "$GROUP" ]]; then
    GROUP=$(imds tags/instance/gpu-autorepair:group) ||
        fail "GROUP is empty and the instance metadata has no gpu-autorepair:group tag (InstanceMetadataTags=enabled?)"
fi
check_value GROUP "$GROUP"
case "$PROBE_ARGS" in
    *\"* | *\'* | *\\* | *\$*) fail "PROBE_ARGS '$PROBE_ARGS' holds a quote, a backslash or a \$" ;;
esac

python=$(find_python) || {
    log "installing Python 3.11+ and its venv module"
    install_python
    python=$(find_python) || fail "no Python 3.11 or later with its venv module after installing it"
}
log "Python: $python ($("$python" --version 2>&1))"

# The environment: created once, created again when its Python is gone or too old (an OS upgrade).
if ! python_ok "$PREFIX/bin/python"; then
    rm -rf "$PREFIX"
    "$python" -m venv "$PREFIX"
fi
pip_args=(--disable-pip-version-check --no-input --quiet --prefer-binary)
if [[ -n "$INDEX_URL" ]]; then
    pip_args+=(--index-url "$INDEX_URL")
fi
"$PREFIX/bin/pip" install "${pip_args[@]}" "gpu-autorepair[probe]==$AUTOREPAIR_VERSION"
installed=$("$PREFIX/bin/autorepair" --version)
[[ "$installed" == *" $AUTOREPAIR_VERSION" ]] || fail "installed '$installed', not $AUTOREPAIR_VERSION"
log "$installed in $PREFIX"

install -d -m 0755 "$CONF_DIR"
if [[ -n "$INGEST_CA_PEM" ]]; then
    printf '%s\n' "$INGEST_CA_PEM" >"$CA_FILE.new"
    chmod 0644 "$CA_FILE.new"
    mv -f "$CA_FILE.new" "$CA_FILE"
else
    rm -f "$CA_FILE"
fi
{
    echo "# Written by install-probe.sh (gpu-autorepair $AUTOREPAIR_VERSION): run it again to change this."
    echo "AUTOREPAIR_PROBE_GROUP=$GROUP"
    echo "AUTOREPAIR_PROBE_INGEST=$INGEST_URL"
    echo "AUTOREPAIR_PROBE_ARGS=$PROBE_ARGS"
    echo "AWS_REGION=$STS_REGION"
    if [[ -n "$INGEST_CA_PEM" ]]; then
        echo "SSL_CERT_FILE=$CA_FILE"
    fi
} >"$ENV_FILE.new"
chmod 0640 "$ENV_FILE.new"
mv -f "$ENV_FILE.new" "$ENV_FILE"

cat >"$UNIT_FILE.new" <<'UNIT'
# gpu-autorepair node probe on each GPU host (ECS-on-EC2 container instance or any EC2 GPU host).
# It reads the kernel log, classifies NVIDIA Xid faults and reports them to the ingest (`autorepair ingest`) over
# HTTPS. It makes no AWS calls: the instance id comes from IMDSv2, and it proves who it is by signing, not sending, an
# sts:GetCallerIdentity with the instance profile's credentials (from IMDS), which needs no IAM permission.
# Installed at first boot by deploy/systemd/install-probe.sh (launch template user data), which writes this unit,
# /opt/gpu-autorepair (pip install 'gpu-autorepair[probe]') and /etc/autorepair/autorepair.env with
# AUTOREPAIR_PROBE_GROUP and AUTOREPAIR_PROBE_INGEST (the probe refuses to start without them).
# GET /healthz on 127.0.0.1:8482 (--health-bind): 503 when no heartbeat went out for 3 heartbeat intervals.
# GET /metrics (Prometheus) and /healthz on 0.0.0.0:9482 (--metrics-bind): the GPU hosts' security group says who
# reaches it; AUTOREPAIR_PROBE_METRICS_BIND=off in autorepair.env serves none.
[Unit]
Description=gpu-autorepair node probe (NVIDIA Xid faults from the kernel log, heartbeats, to the ingest)
Documentation=https://github.com/gpu-autorepair/gpu-autorepair/blob/main/deploy/README.md
Wants=network-online.target
# After the NVIDIA driver's modules and nodes exist: DeviceAllow=char-nvidia-frontend below is resolved when the
# unit starts, so a probe started before the module loads could never open /dev/nvidia* (NVML would stay
# INSUFFICIENT_DATA until a restart). Ordering only: the probe still starts, and reads the kernel log, without them.
After=network-online.target systemd-modules-load.service nvidia-persistenced.service

[Service]
Type=exec
DynamicUser=yes
# /var/lib/autorepair/spool: findings wait here while the ingest is unreachable, and survive restarts.
StateDirectory=autorepair/spool
StateDirectoryMode=0700
Environment=AUTOREPAIR_LOG_FORMAT=json
# The kernel log source, and any other flag: /dev/kmsg by default; AUTOREPAIR_PROBE_ARGS=--journald in
# autorepair.env where only the journal keeps the kernel log (the systemd-journal group below lets it read).
Environment=AUTOREPAIR_PROBE_ARGS=--kmsg
Environment=AUTOREPAIR_PROBE_METRICS_BIND=0.0.0.0:9482
EnvironmentFile=-/etc/autorepair/autorepair.env
ExecStart=/opt/gpu-autorepair/bin/autorepair probe --group ${AUTOREPAIR_PROBE_GROUP} --ingest ${AUTOREPAIR_PROBE_INGEST} --spool-dir /var/lib/autorepair/spool --metrics-bind ${AUTOREPAIR_PROBE_METRICS_BIND} $AUTOREPAIR_PROBE_ARGS
Restart=always
RestartSec=5
TimeoutStopSec=20
KillSignal=SIGTERM
# The probe is what reports the host broken: keep it alive under memory pressure, and keep it small.
OOMScoreAdjust=-900
MemoryMax=256M

# Least privilege: CAP_SYSLOG to read /dev/kmsg when kernel.dmesg_restrict=1, and no other capability.
AmbientCapabilities=CAP_SYSLOG
CapabilityBoundingSet=CAP_SYSLOG
# --journald: `journalctl -k` reads the system journal as a member of its group.
SupplementaryGroups=systemd-journal
# The CONTAINER_RUNTIME check asks dockerd on /var/run/docker.sock (root:docker 0660) only as a member of its group:
# install-probe.sh adds SupplementaryGroups=docker in autorepair-probe.service.d/runtime-socket.conf where the host
# has that group (a missing group would stop the unit from starting). Without it, docker's unit alone is judged, and
# the source's status says so; containerd's socket is root's alone, so containerd is always judged by its unit.
NoNewPrivileges=yes
# Devices: only the kernel log (read) and the NVIDIA driver's nodes (NVML: /dev/nvidiactl, /dev/nvidia0..N are
# major "nvidia-frontend"; MIG capabilities are "nvidia-caps"). No PrivateDevices: it would hide them.
DevicePolicy=closed
DeviceAllow=/dev/kmsg r
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-caps r
# Not ProtectKernelLogs=: it denies /dev/kmsg, the probe's input.
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
UMask=0077

[Install]
WantedBy=multi-user.target
UNIT
chmod 0644 "$UNIT_FILE.new"
mv -f "$UNIT_FILE.new" "$UNIT_FILE"

DROP_IN="$UNIT_FILE.d/runtime-socket.conf"
if [[ -n "$RUNTIME_SOCKET_GROUP" ]] && getent group "$RUNTIME_SOCKET_GROUP" >/dev/null; then
    mkdir -p "$UNIT_FILE.d"
    printf '[Service]\n# Written by install-probe.sh: the container runtime checked through its socket.\nSupplementaryGroups=%s\n' \
        "$RUNTIME_SOCKET_GROUP" >"$DROP_IN.new"
    chmod 0644 "$DROP_IN.new"
    mv -f "$DROP_IN.new" "$DROP_IN"
    log "the probe joins group $RUNTIME_SOCKET_GROUP: the container runtime is checked through its socket"
else
    rm -f "$DROP_IN"
fi

systemctl daemon-reload
systemctl enable autorepair-probe.service
# --no-block: cloud-init itself is a unit in the boot transaction; the probe starts once the boot lets it.
systemctl restart --no-block autorepair-probe.service
log "autorepair-probe.service enabled and (re)started: group $GROUP, ingest $INGEST_URL"

#!/usr/bin/env bash
# An emulated cluster of N hosts on this machine: network namespaces on a
# bridge, every link rate-limited in both directions. Must run as root; `up`
# installs what it needs (ip and tc from iproute2, ping, iperf3) with apt-get
# when they are missing.
#
#   netns_cluster.sh up N RATE [MTU]     hosts 0..N-1, links of RATE (1gbit, 500mbit, 10gbit...)
#   netns_cluster.sh down                remove every namespace `up` made
#   netns_cluster.sh exec I CMD...       run CMD on host I
#   netns_cluster.sh addr I              print host I's address
#   netns_cluster.sh iperf I J [SECS]    one TCP stream from host J to host I (iperf3)
#   netns_cluster.sh launch N CMD...     run CMD as ranks 0..N-1 of a ringcore job, rank i on host i;
#                                        PER_HOST=L: L ranks per host (rank h*L+l on host h), each
#                                        host with its own host name and /dev/shm
#   netns_cluster.sh status              namespaces, addresses, bytes through each shaper
#
# Layout. Host i is namespace rch<i> with one interface, eth0 = 10.213.0.<i+1>/24,
# one end of a veth pair; the other end, sw<i>, is a port of bridge br0, which
# lives in its own namespace rchsw (nothing is added to the root namespace).
# A token bucket (tbf) at RATE sits on eth0 (the host's uplink) and on sw<i>
# (the switch's downlink to the host): a full-duplex link of RATE per host
# into a non-blocking switch. The namespaces have no default route, so
# traffic stays on 10.213.0.0/24 inside the emulated cluster.
#
# tbf counts whole Ethernet frames: with MTU 1500 TCP goodput tops out near
# 95% of RATE, so busbw / link close to 0.95 is the ceiling.
#
# Example: a 4-host 1 Gbit/s cluster and an allreduce sweep on it
#   bench/netns_cluster.sh up 4 1gbit
#   bench/netns_cluster.sh iperf 0 1 5
#   bench/netns_cluster.sh launch 4 .venv/bin/python -m ringcore.bench.cli -b 16M -e 64M -f 4
#   bench/netns_cluster.sh down
set -euo pipefail

HOST=rch          # host namespaces: rch0, rch1, ...
SWITCH=rchsw      # the bridge's namespace
NET=10.213.0      # private /24, exists only inside these namespaces
PORT=29511        # rendezvous port of `launch` (on host 0)

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

have() { [ -x "$(command -v "$1")" ]; }

# need TOOL...: install the Debian packages of the missing TOOLs (root, apt-get), or say which.
need() {
    local -A package=([ip]=iproute2 [tc]=iproute2 [ping]=iputils-ping [iperf3]=iperf3)
    local tool missing=()
    for tool in "$@"; do
        have "$tool" || missing+=("${package[$tool]}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    if [ "$(id -u)" -eq 0 ] && have apt-get; then
        echo "installing ${missing[*]} (apt-get)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null \
            || echo "apt-get could not install ${missing[*]}" >&2
    fi
    for tool in "$@"; do
        have "$tool" \
            || { echo "$tool not found: apt-get install ${package[$tool]} (as root)" >&2; exit 1; }
    done
}

need_root() { [ "$(id -u)" -eq 0 ] || { echo "$0: must run as root (network namespaces)" >&2; exit 1; }; }

# tc rate -> bytes per second (tc's units are SI: 1gbit = 1e9 bit/s)
rate_bytes() {
    local r=${1,,}
    case $r in
        *gbit) echo $(( ${r%gbit} * 1000000000 / 8 )) ;;
        *mbit) echo $(( ${r%mbit} * 1000000 / 8 )) ;;
        *kbit) echo $(( ${r%kbit} * 1000 / 8 )) ;;
        *) echo "rate '$1' not understood; use e.g. 10gbit, 1gbit, 500mbit" >&2; exit 2 ;;
    esac
}

ours() { ip netns list | awk '{print $1}' | grep -E "^(${HOST}[0-9]+|${SWITCH})$" || true; }
hosts() { ours | grep -E "^${HOST}[0-9]+$" | wc -l; }
addr() { echo "$NET.$(( $1 + 1 ))"; }

need_host() {
    ip netns list | awk '{print $1}' | grep -qx "${HOST}$1" \
        || { echo "no host $1: run '$0 up N RATE' first (hosts now: $(hosts))" >&2; exit 1; }
}

down() {
    local ns
    for ns in $(ours); do
        ip netns del "$ns"   # deleting a namespace destroys the veth ends inside it
    done
    for _ in $(seq 50); do  # interfaces go away asynchronously
        [ -z "$(ours)" ] && break
        sleep 0.1
    done
    [ -z "$(ours)" ] || { echo "down: still there: $(ours)" >&2; exit 1; }
    echo "down: no ${HOST}*/${SWITCH} namespaces left"
}

up() {
    local n=${1:?N} rate=${2:?RATE} mtu=${3:-1500}
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || { echo "N must be 1..250" >&2; exit 2; }
    need_root
    need ip tc ping iperf3  # iperf3: `iperf`, the first thing to run on a new cluster
    local bps; bps=$(rate_bytes "$rate")
    # bucket: 2 ms at RATE but at least 64 KiB, so one TSO/GSO packet fits;
    # queue: 50 ms, deep enough that a TCP window (a few MiB) is not dropped
    local burst=$(( bps / 500 ))
    [ "$burst" -lt 65536 ] && burst=65536
    [ -n "$(ours)" ] && down >/dev/null
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link add br0 type bridge stp_state 0 forward_delay 0
    ip -n "$SWITCH" link set br0 up
    local i ns
    for i in $(seq 0 $(( n - 1 ))); do
        ns=${HOST}$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$ns" link add eth0 mtu "$mtu" type veth peer name "sw$i" netns "$SWITCH" mtu "$mtu"
        ip -n "$SWITCH" link set "sw$i" master br0 up
        ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
        tc -n "$SWITCH" qdisc add dev "sw$i" root tbf rate "$rate" burst "$burst" latency 50ms
    done
    for i in $(seq 1 $(( n - 1 ))); do
        ip netns exec "${HOST}$i" ping -c 1 -W 2 "$(addr 0)" >/dev/null \
            || { echo "up: host $i cannot reach $(addr 0)" >&2; exit 1; }
    done
    echo "up: $n hosts ${HOST}0..${HOST}$(( n - 1 )) = $(addr 0)..$(addr $(( n - 1 )))," \
         "links $rate both ways (tbf burst ${burst} B), mtu $mtu, bridge br0 in netns $SWITCH"
}

iperf() {
    local i=${1:?I} j=${2:?J} secs=${3:-5}
    need_host "$i"; need_host "$j"
    need iperf3
    ip netns exec "${HOST}$i" timeout $(( secs + 20 )) iperf3 -s -1 -B "$(addr "$i")" -p 5201 >/dev/null &
    local srv=$!
    sleep 0.5
    ip netns exec "${HOST}$j" timeout $(( secs + 20 )) iperf3 -c "$(addr "$i")" -p 5201 -t "$secs" \
        | grep -E "sender|receiver"
    wait "$srv"
}

launch() {
    local n=${1:?N}; shift
    [ $# -gt 0 ] || usage
    local per=${PER_HOST:-1}
    [[ $per =~ ^[0-9]+$ ]] && [ "$per" -ge 1 ] || { echo "PER_HOST must be a positive number" >&2; exit 2; }
    local i pids=() rc=0 host_count=$(( (n + per - 1) / per ))
    for i in $(seq 0 $(( host_count - 1 ))); do need_host "$i"; done
    local secret=${RINGCORE_SECRET:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
    # The emulated hosts share this machine's cores, which ringcore cannot see (each host's
    # ranks see only their host): busy-polling would steal the CPU of another host's rank, so it
    # is off unless RINGCORE_SPIN_US says otherwise.
    local spin=${RINGCORE_SPIN_US:-0}
    for i in $(seq 0 $(( host_count - 1 ))); do
        # The secret goes in the environment, not on a command line (`ps` shows those).
        if [ "$per" -eq 1 ]; then
            RINGCORE_SECRET="$secret" ip netns exec "${HOST}$i" env RINGCORE_RANK="$i" RINGCORE_SIZE="$n" \
                RINGCORE_LOCAL_RANK=0 RINGCORE_LOCAL_SIZE=1 RINGCORE_SPIN_US="$spin" RINGCORE_ADDR="$(addr 0)" \
                RINGCORE_PORT="$PORT" RINGCORE_IFNAME=eth0 PYTHONUNBUFFERED=1 "$@" &
        else
            # Several ranks per host: the host gets its own host name and its own /dev/shm (new
            # UTS and mount namespaces), as a real host has, so ranks find their local peers by
            # host name and shared memory, and other hosts' ranks are not local.
            RINGCORE_SECRET="$secret" ip netns exec "${HOST}$i" unshare --uts --mount --propagation private \
                env HOST_INDEX="$i" PER="$per" N="$n" SPIN="$spin" ADDR0="$(addr 0)" PORT="$PORT" \
                bash -c 'hostname "rch$HOST_INDEX" && mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm || exit 1
                    pids=()
                    for l in $(seq 0 $(( PER - 1 ))); do
                        r=$(( HOST_INDEX * PER + l )); [ "$r" -lt "$N" ] || break
                        env RINGCORE_RANK="$r" RINGCORE_SIZE="$N" RINGCORE_LOCAL_RANK="$l" \
                            RINGCORE_SPIN_US="$SPIN" RINGCORE_ADDR="$ADDR0" RINGCORE_PORT="$PORT" \
                            RINGCORE_IFNAME=eth0 PYTHONUNBUFFERED=1 "$@" &
                        pids+=("$!")
                    done
                    rc=0
                    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
                    exit "$rc"' _ "$@" &
        fi
        pids+=("$!")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { local code=$?; [ "$rc" -eq 0 ] && rc=$code && echo "launch: host $i exited $code" >&2; }
    done
    return "$rc"
}

status() {
    local ns dev
    for ns in $(ours | sort -V); do
        echo "== $ns"
        ip -n "$ns" -br -4 addr
        for dev in $(ip -n "$ns" -o link show type veth | awk -F'[:@ ]+' '{print $2}'); do
            echo "   $dev: $(tc -n "$ns" -s qdisc show dev "$dev" | grep -m1 -o 'Sent.*')"
        done
    done
}

cmd=${1:-}
shift || true
case $cmd in
    up) up "$@" ;;
    down) down ;;
    exec) i=${1:?I}; shift; need_host "$i"; exec ip netns exec "${HOST}$i" "$@" ;;
    addr) addr "${1:?I}" ;;
    iperf) iperf "$@" ;;
    launch) launch "$@" ;;
    status) status ;;
    *) usage ;;
esac

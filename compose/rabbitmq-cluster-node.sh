#!/bin/sh
# Starts one node of the three-node broker (compose/stack.broker-cluster.yml) so that the
# three form one cluster whatever order Swarm starts them in, and every quorum queue and
# stream has a member on every node.
#
# Peer discovery (classic_config: the nodes listed in the cluster's conf file) joins a node
# whose database is empty to the first listed node that runs, and starts it as a cluster of
# its own when none runs. Three empty nodes started at once could so form two clusters.
# Here only the seed (the first node listed) may start empty on its own; any other node
# starting empty waits until a node of the list runs, then joins it. A node with a database
# starts at once: it knows its cluster (the two others may be down: the node must come up).
#
# A quorum queue or stream gets its members when it is declared, from the nodes running
# then: the definitions' queues, declared when the seed starts alone, would have one member
# and be lost with its node. So once this node runs, it makes itself a member of every
# quorum queue and stream of every vhost it is not a member of yet, tries again until it is
# one of all (an attempt can fail while the cluster settles), and looks again every
# $CHECK_S seconds: a queue declared while this node was down or still joining (the
# allocator declares the ledger log's stream at its first start, often before the other two
# nodes have joined the seed) has one member until then. A look is two CLI calls.
#
# A stream is only joined once this node runs a member of the stream coordinator (the Raft
# cluster that places streams' replicas). In RabbitMQ 3.10 a node that joined the cluster after
# the coordinator started is taken in by the coordinator's leader at its next tick; a stream
# command on the node before then (an add_replica here, say) starts a second coordinator on the
# nodes that lack one, and every later command for the stream times out ("Coordinator
# timeout"). The tick is every 30 s by default; here every $STREAM_TICK_MS ms.
set -eu

conf=/etc/rabbitmq/conf.d/30-swarm-gpu-cluster.conf
nodes=$(sed -n 's/^cluster_formation\.classic_config\.nodes\.[0-9]*[[:space:]]*=[[:space:]]*//p' "$conf")
seed=$(printf '%s\n' "$nodes" | head -n 1)
me=${RABBITMQ_NODENAME:?the node name}
database=${RABBITMQ_MNESIA_BASE:-/var/lib/rabbitmq/mnesia}/$me
WAIT_S=5
CHECK_S=30
STREAM_TICK_MS=5000

log() { printf 'rabbitmq-cluster-node: %s\n' "$*" >&2; }
running() { rabbitmq-diagnostics -q -n "$1" check_running >/dev/null 2>&1; }

peer_running() {
    for node in $nodes; do
        if [ "$node" != "$me" ] && running "$node"; then
            log "$node runs: $me joins it"
            return 0
        fi
    done
    return 1
}

tab=$(printf '\t')

coordinator_member() { # whether this node runs a member of the stream coordinator
    [ "$(rabbitmqctl -q eval 'whereis(rabbit_stream_coordinator) =/= undefined.' 2>/dev/null)" = true ]
}

not_member() { # the quorum queues and streams without a member here: VHOST TYPE NAME lines
    vhosts=$(rabbitmqctl -q list_vhosts --no-table-headers name) || return 1
    for vhost in $vhosts; do
        queues=$(rabbitmqctl -q list_queues -p "$vhost" --no-table-headers name type members) \
            || return 1
        printf '%s\n' "$queues" | while IFS=$tab read -r queue type members; do
            case $type in quorum | stream) ;; *) continue ;; esac
            # members: [rabbit@a, rabbit-2@b]
            case "$members" in
                "[$me]" | "[$me,"* | *" $me,"* | *" $me]") ;;
                *) printf '%s\t%s\t%s\n' "$vhost" "$type" "$queue" ;;
            esac
        done
    done
}

join_queues() {
    until running "$me"; do sleep "$WAIT_S"; done
    while :; do
        missing=$(not_member) || missing="?"
        if [ -z "$missing" ]; then
            [ -n "${joined:-}" ] || log "$me: a member of every quorum queue and stream"
            joined=1
            sleep "$CHECK_S"
            continue
        fi
        printf '%s\n' "$missing" | while IFS=$tab read -r vhost type queue; do
            if [ "$type" = stream ] && ! coordinator_member; then
                log "$me: not a member of the stream coordinator yet; stream $queue later"
                continue
            fi
            case $type in
                quorum) rabbitmq-queues -q add_member -p "$vhost" "$queue" "$me" ;;
                stream) rabbitmq-streams -q add_replica -p "$vhost" "$queue" "$me" ;;
                *) false ;;
            esac >/dev/null 2>&1 \
                && log "$me: now a member of $type $queue (vhost $vhost)" \
                || log "$me: could not join $type ${queue:-?} (vhost ${vhost:-?}) yet; again in ${WAIT_S}s"
        done
        joined=
        sleep "$WAIT_S"
    done
}

if [ ! -d "$database" ] && [ "$me" != "$seed" ]; then
    log "$me starts empty: waiting for a node of [$(echo $nodes)] to run"
    until peer_running; do sleep "$WAIT_S"; done
fi
join_queues &
RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="${RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS:-} -rabbit stream_tick_interval $STREAM_TICK_MS"
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS
exec rabbitmq-server

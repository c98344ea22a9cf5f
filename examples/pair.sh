#!/bin/sh
# A primary and its standby on this machine (docs/ha.md): two members of one shard, each
# with its own data dir under DIR (default ./cmdbus-pair), agreeing through a file lease.
# Member a listens on the default ports (control 9090, command ingest 9100, ...), member b
# on the same ports + 100 (control 9190, command ingest 9200, ...); CMDBUS_PAIR_BASE=0
# puts every face on a free port instead, listed in DIR/a/ports.json and DIR/b/ports.json.
# Ctrl-C (or SIGTERM) stops both.
set -eu
dir=${1:-./cmdbus-pair}
base=${CMDBUS_PAIR_BASE:-9090}
mkdir -p "$dir"

member() {  # name, port offset
    port() { if [ "$base" = 0 ]; then echo "127.0.0.1:0"; else echo "127.0.0.1:$((base + $1 + $2))"; fi; }
    exec cmdbus-trio serve --data-dir "$dir/$1" --ports-file "$dir/$1/ports.json" \
        --ha-lease "file:$dir/lease" --ha-name "$1" --ha-bind "$(port "$2" 30)" \
        --control-bind "$(port "$2" 0)" --cmd-ingest-bind "$(port "$2" 10)" \
        --cmd-claim-bind "$(port "$2" 11)" --evt-ingest-bind "$(port "$2" 13)" \
        --evt-claim-bind "$(port "$2" 14)" --evt-subscribe-bind "$(port "$2" 18)" \
        --tier-bind "$(port "$2" 20)"
}

member a 0 &
first=$!
sleep 1  # a takes the lease first; b copies it and follows
member b 100 &
second=$!
trap 'kill "$first" "$second" 2>/dev/null || true' INT TERM
wait

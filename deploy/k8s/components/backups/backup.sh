#!/bin/sh
# A backup of every writer pod, run by the CronJob: `cmdbus-trio backup` inside each pod
# (online: the writer keeps serving) to $BACKUPS/<UTC time>, then the newest $KEEP
# complete backups kept there (a complete one has its manifest.json) and the rest
# removed. Exits 1 if any pod's backup failed, after trying every pod.
set -u
NAMESPACE=${NAMESPACE:-cmdbus}
SELECTOR=${SELECTOR:-app.kubernetes.io/name=cmdbus-trio}
KEEP=${KEEP:-7}
DATA_DIR=${DATA_DIR:-/var/lib/cmdbus}
BACKUPS=${BACKUPS:-/backups}

pods=$(kubectl -n "$NAMESPACE" get pods -l "$SELECTOR" -o name) || exit 1
[ -n "$pods" ] || { echo "no pods match $SELECTOR in $NAMESPACE" >&2; exit 1; }
stamp=$(date -u +%Y%m%dT%H%M%SZ)
failed=0
for pod in $pods; do
    if kubectl -n "$NAMESPACE" exec "$pod" -c writer -- \
        cmdbus-trio backup --data-dir "$DATA_DIR" --to "$BACKUPS/$stamp" --json; then
        # Older than the newest $KEEP complete backups: removed, complete or not (the
        # names sort by time; only names this script gives are touched).
        kubectl -n "$NAMESPACE" exec "$pod" -c writer -- sh -c '
            cd "$1" || exit 1
            kept=0
            for dir in $(ls -1 | grep -E "^[0-9]{8}T[0-9]{6}Z$" | sort -r); do
                if [ "$kept" -lt "$2" ] && [ -e "$dir/manifest.json" ]; then
                    kept=$((kept + 1))
                elif [ "$kept" -ge "$2" ]; then
                    rm -rf "$dir"
                fi
            done' prune "$BACKUPS" "$KEEP" || failed=1
    else
        echo "the backup of $pod failed" >&2
        failed=1
    fi
done
exit "$failed"

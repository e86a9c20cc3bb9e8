#!/usr/bin/env bash
# Blue-green rollout of a new sdserve image, gated on canary benchmarks, with automatic rollback.
#
#   deploy/rollout.sh IMAGE
#
# 1. The Service's active color (blue/green) is read; the other color becomes the candidate.
# 2. The candidate Deployment is rendered from the matrix and profile (`sdserve deploy render`) and applied.
# 3. `kubectl rollout status` waits: a pod is Ready only once its /ready is 200, i.e. after preflight, session
#    build, placement audit and the canary self-test passed on that node (the startup probe covers the boot).
# 4. Both colors are benchmarked through port-forwards with the same canary load (`sdserve bench`).
# 5. `sdserve gate` compares them. Regression -> the candidate is deleted (rollback), exit 1.
#    No regression -> the Service is switched to the candidate; the old color keeps running until you delete it.
#
# Environment: KUBECTL (default kubectl), SDSERVE (default sdserve), NAMESPACE, ROLLOUT_TIMEOUT (900s),
# BENCH_ARGS (default "--concurrency 1,4 --requests 16"), PORT_FORWARD_WAIT (seconds, default 3).
set -euo pipefail

image=${1:?usage: deploy/rollout.sh IMAGE}
kubectl=${KUBECTL:-kubectl}
sdserve=${SDSERVE:-sdserve}
ns=(--namespace "${NAMESPACE:-default}")
read -r -a bench_args <<< "${BENCH_ARGS:---concurrency 1,4 --requests 16}"
work=$(mktemp -d)
forwards=()
cleanup() {
  for pid in "${forwards[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

active=$("$kubectl" "${ns[@]}" get service sdserve -o 'jsonpath={.spec.selector.sdserve/color}')
case "$active" in
  blue) candidate=green ;;
  green) candidate=blue ;;
  *) echo "rollout: cannot read the active color from service/sdserve (got '$active')" >&2; exit 2 ;;
esac
echo "rollout: active $active, candidate $candidate ($image)"

"$sdserve" deploy render --image "$image" --color "$candidate" --active "$active" --out "$work/k8s" \
  --dashboard "$work/dashboard.json"
"$kubectl" "${ns[@]}" apply -f "$work/k8s/deployment.yaml" -f "$work/k8s/pdb.yaml" -f "$work/k8s/hpa.yaml"

rollback() {
  echo "rollout: $1 -> rolling back: deleting the $candidate deployment; traffic stays on $active" >&2
  "$kubectl" "${ns[@]}" delete deployment "sdserve-$candidate" --ignore-not-found
  "$kubectl" "${ns[@]}" delete pdb "sdserve-$candidate" --ignore-not-found
  "$kubectl" "${ns[@]}" delete hpa "sdserve-$candidate" --ignore-not-found
  exit 1
}

if ! "$kubectl" "${ns[@]}" rollout status "deployment/sdserve-$candidate" --timeout "${ROLLOUT_TIMEOUT:-900s}"; then
  rollback "the candidate never became ready (see its /ready reasons and exit code)"
fi

bench() {  # color port out
  "$kubectl" "${ns[@]}" port-forward "deployment/sdserve-$1" "$2:8000" >/dev/null &
  forwards+=("$!")
  sleep "${PORT_FORWARD_WAIT:-3}"
  "$sdserve" bench --url "http://127.0.0.1:$2" "${bench_args[@]}" --out "$3"
}
bench "$active" 18080 "$work/baseline.json" || rollback "the baseline benchmark failed"
bench "$candidate" 18081 "$work/candidate.json" || rollback "the candidate benchmark failed"

if ! "$sdserve" gate --baseline "$work/baseline.json" --candidate "$work/candidate.json"; then
  rollback "sdserve gate found a regression"
fi

"$kubectl" "${ns[@]}" patch service sdserve --type merge \
  -p "{\"spec\":{\"selector\":{\"sdserve/color\":\"$candidate\"}}}"
echo "rollout: traffic switched to $candidate; delete deployment/sdserve-$active when satisfied"

# ab: same-machine A/B of the layer. AB_BASE_TGZ (e.g. `git archive REV dsv4_model bench dsv4_ops | gzip`) is the
# base tree; it runs on this tree's built library (valid only when the op sources did not change). Base and this
# tree alternate AB_ROUNDS times so machine drift hits both alike.
if [ -z "${AB_BASE_TGZ:-}" ]; then note "ab: AB_BASE_TGZ not set"; return 0; fi
AB_DIR=$(mktemp -d)
[ -n "$DRY" ] || { tar -xzf "$AB_BASE_TGZ" -C "$AB_DIR" && cp dsv4_ops/*.so "$AB_DIR/dsv4_ops/"; }
for round in $(seq "${AB_ROUNDS:-2}"); do
  for side in base head; do
    dir=$PWD; [ "$side" = base ] && dir=$AB_DIR
    step "ab_${side}_$round" 200 env PYTHONPATH="$dir" $PY "$dir/bench/bench_layer.py" --kinds csa,hca,swa \
      --steps 50 --experts 16
    note "  $(grep -hsE '^(csa|hca|swa) ' "$LOGS/ab_${side}_$round.log" | tr -s ' ' | tr '\n' ';')"
  done
done

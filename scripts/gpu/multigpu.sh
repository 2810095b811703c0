# multigpu: issue #32 on a machine of 2+ GPUs (every GPU it has; NVLink multicast stays as the machine sets it).
#   1. correctness: the same random 43-layer model (MULTIGPU_CHECK_EXPERTS routed experts, default 32: one GPU holds
#      it) on one GPU and expert parallel on all: bench/parallel_greedy.py's tokens and logits compared;
#   2. V4-Flash at full size (MULTIGPU_EXPERTS, default: as many of the 256 as fit) expert parallel over all GPUs:
#      bench/bench_parallel_decode.py at 4K context, B = 1 / 8 / 64, then B = 1 at 128K (regional compile).
# MULTIGPU_ARGS: more bench_parallel_decode arguments (e.g. --regional for the 4K run too). MULTIGPU_STEPS (default
# "check 4k 128k"): which of the three run (all of them may not fit one 10-minute call: split them over two).
NG=$([ -n "$DRY" ] && echo 2 || nvidia-smi -L | wc -l)
TR=($PY -m torch.distributed.run --standalone --nproc-per-node "$NG")
if [ "$NG" -lt 2 ]; then note "[multigpu] skipped: $NG GPU on this machine"; else
  steps=" ${MULTIGPU_STEPS:-check 4k 128k} "
  if [[ $steps == *" check "* ]]; then
    check=(bench/parallel_greedy.py --layers 43 --experts "${MULTIGPU_CHECK_EXPERTS:-32}" --steps 32)
    step multigpu_greedy_1 240 $PY "${check[@]}" --out "$LOGS/greedy_1.pt"
    step multigpu_greedy_$NG 240 "${TR[@]}" "${check[@]}" --out "$LOGS/greedy_$NG.pt"
    step multigpu_compare 60 $PY bench/parallel_greedy.py --compare "$LOGS/greedy_1.pt" "$LOGS/greedy_$NG.pt"
    [ -n "$DRY" ] || note "  $(tail -n 2 "$LOGS/multigpu_compare.log" | tr '\n' ' ')"
  fi
  experts=(); [ -n "${MULTIGPU_EXPERTS:-}" ] && experts=(--experts "$MULTIGPU_EXPERTS")
  for f in 4k 128k; do
    [[ $steps == *" $f "* ]] || continue
    if [ $f = 4k ]; then args=(--context 4096 --batches 1,8,64 ${MULTIGPU_ARGS:-}); limit=420
    else args=(--context 131072 --batches 1 --regional); limit=300; fi
    step multigpu_decode_$f $limit "${TR[@]}" bench/bench_parallel_decode.py --layers 43 \
      ${experts[@]+"${experts[@]}"} "${args[@]}"
    [ -n "$DRY" ] || note "$(grep -hsvE '^\[dsv4\]|Warning|warn' "$LOGS/multigpu_decode_$f.log" | tail -n 9)"
  done
fi

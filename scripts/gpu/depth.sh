# depth: compile + capture against depth: whole-step vs regional compilation of a 43-layer V4-Flash-width model and
# the 2-layer slice, each cold and warm in fresh processes.
step compile_depth 580 $PY bench/bench_compile_depth.py --models flash43,flash2
note "  $(grep -hsE 'prepare|vs whole' "$LOGS/compile_depth.log" | tr '\n' ' ')"

# profile: Nsight Compute on the NVFP4 linear (PROFILE_ARGS: e.g. --m 1,16,64; default the batch-1 GEMV and MoE):
# what bounds them; text report in the logs.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$DRY" ] && NCU=${NCU:-ncu}
if [ -z "$NCU" ]; then note "no ncu"; return 0; fi
step profile_gemv 300 "$NCU" --clock-control none --kernel-name "regex:nvfp4" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
  --section Occupancy --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis \
  $PY bench/profile_nvfp4_gemv.py ${PROFILE_ARGS:-}

# issue 27: call 1's two cases again (8B 8x4096 at 10 GB / 64 GB host; 3B 16x4096 at 10 GB / 32 GB host), every
# decision auto, after call 5's finding: a resweep's second sweep sent gradients faster than the pinned slabs took
# them, and 26 of the 3B's 28 block gradients waited on the GPU. Now at most HOLD_COPIES_IN_FLIGHT wait
# (updaters._bound_waiting) and the plan counts it for the resweep too.
bash experiments/calls/s14_call1_resweep_io.sh

# The distributed optimizer's param groups (issue 43 item 2, issue 44 item 1): per-group
# hyperparameters, untrained and frozen params, per-param steps, unscale/clip multipliers, Adam's L2
# decay, against a scalar reference. Included from tests/CMakeLists.txt, where mxddp_test is defined.
mxddp_test(optim_param_groups_test optim/param_groups_test.cc)

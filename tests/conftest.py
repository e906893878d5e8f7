"""Every test process sees 8 emulated CPU devices, as the design asks (docs/architecture.md)."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # the Keras tests run Keras 3 on JAX
# verdicts of select_by_compiling: this run's own, never a home directory's older ones
os.environ.setdefault("XLA_STRATEGIES_CACHE", tempfile.mkdtemp(prefix="xla_strategies_cache_"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_finish(session):
    # a module that sets the device count when imported (a worker script's constants
    # imported by a test) would leave every test of the run on the wrong number of devices
    assert jax.config.jax_num_cpu_devices == 8, (
        f"a test module set jax_num_cpu_devices to {jax.config.jax_num_cpu_devices} on import"
    )


def pytest_report_header(config):
    # Two tested JAX releases run this suite (`make test`, `make test-oldest-jax`): say which.
    import sys

    return f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, Python {sys.version.split()[0]}"


# The end-to-end cases that take 25 s and more each on 2 cores, and some shorter ones once
# `make test` neared its 7 minutes: `make test-slow` runs them
# (CI too), `make test` the rest, so that it stays within 7 minutes. Node ids, or their
# prefixes for every parameter of a test.
SLOW_TESTS = (
    # moved when make test read 397.7 and 404.0 s on 2 cores (2026-11-27)
    "tests/runtime/test_checkpoint.py::test_a_save_killed_midway_never_becomes_the_latest",
    "tests/test_aot_command.py::test_aot_runs_python_dash_c_and_does_not_reprint_an_earlier_runs_summary",
    "tests/test_tpu_compile_only.py::test_aot_compiles_an_unchanged_training_script_for_a_topology",
    "tests/passes/test_pass_numerics.py::test_default_pipeline_leaves_one_reduction_per_step_on_the_transformer",
    "tests/test_parameter_sharding.py::test_without_remat_the_backward_loop_gathers_again_instead_of_stacking_weights",
    "tests/runtime/test_preemption.py::test_two_workers_resume_bitwise_after_a_save_at_step_5",
    "tests/passes/test_pass_numerics.py::test_each_pass_preserves_the_numbers[transformer]",
    "tests/passes/test_decompose_all_reduces.py::test_decomposed_training_matches_one_device",
    "tests/test_multi_worker.py::test_two_workers_train_like_one_device",
    "tests/test_multi_worker.py::test_a_killed_peer_fails_the_survivor_within_the_timeout",
    "tests/test_multi_worker_faults.py::",
    "tests/test_parameter_sharding_state.py::test_checkpoints_move_between_replica_counts",
    "tests/test_weight_update_sharding.py::test_clipped_adamw_matches_the_replicated_update[mirrored-transformer]",
    "tests/test_central_storage.py::test_central_storage_matches_mirrored[transformer",
    "tests/frameworks/test_flax_linen.py::test_batchnorm_without_axis_name_keeps_per_replica",
    "tests/frameworks/test_flax_linen.py::test_scanned_remat_lm_with_tied_embedding",
    "tests/torch_models/test_train.py::test_transformer_with_tied_embedding_and_adamw",
    "tests/torch_models/test_train.py::test_checkpoint_saves_and_restores_a_torch_state",
    # two worker processes; 8.8 s alone, but 152 s in one `make test` run beside the other
    # pytest worker (445.8 s in all, 2026-11-27; why not found)
    "tests/test_cluster_resolvers.py::test_slurm_feeds_multi_worker_mirrored_strategy",
    # both transformer cases (13 s each); `make test` keeps the MLP's two
    "tests/test_equivalence.py::test_mirrored_matches_one_device[transformer",
    "tests/test_examples.py::test_train_mlp_resumes_and_saves_on_sigterm",
    # moved when make test read 404.0 s on 2 cores (2026-11-29): four TPU compiles, 30-50 s
    "tests/test_never_worse_than_jit.py::test_a_pipeline_or_sharding_the_user_asked_for_or_an_emulated_chip_is_never_swapped",
    # the flax pipeline case again with nn.relu, a custom_jvp (10 s; 2026-11-29)
    "tests/test_pipeline_stages.py::test_a_flax_model_scanned_with_nn_scan_trains_unchanged[relu]",
    # 11-16 s each, with kin in `make test`: torch parameter sharding (the torch CNN and
    # transformer steps stay), the Keras example (Keras' fit cases stay), a worker that
    # never starts (two-worker training and input cases stay)
    "tests/torch_models/test_train.py::test_parameter_sharding_holds_the_torch_state_split",
    "tests/keras_models/test_fit.py::test_the_keras_example_learns_with_batchnorm_and_uneven",
    "tests/test_multi_worker.py::test_a_worker_that_never_starts_is_a_timeout_error",
    # 14-19 s each, with kin in `make test`: a two-worker sharded update (two-worker input
    # and fault cases stay), the torch example (torch's train cases stay), the Mirrored
    # scanned LM under parameter sharding (its two TPU topologies stay)
    "tests/test_multi_worker.py::test_two_workers_shard_the_weight_update_like_the_replicated",
    "tests/torch_models/test_example.py::test_the_torch_example_learns_and_hands_its_weights",
    "tests/test_parameter_sharding.py::test_scanned_lm_with_clipped_adamw_matches_one_device[mirrored]",
    # the lookup in place on one replica axis (8 s): its two TPU topologies stay
    "tests/test_lookups_in_place.py::test_a_table_split_on_its_features_is_looked_up_where_it_lies[mirrored]",
    # the model axis's framework cases, 3-8 s each: `make test` keeps one of each kind
    "tests/test_model_axis.py::test_an_annotated_scanned_linen_lm_trains_like_one_device",
    "tests/test_model_axis.py::test_an_annotated_nnx_model_trains_like_nnx_jit_and_stays_split[2-False]",
    "tests/test_model_axis.py::test_an_annotated_nnx_model_trains_like_nnx_jit_and_stays_split[4-False]",
    # 7-10 s each, with kin in `make test`: the selects' data-parallel LM (its sharded
    # case stays), the scanned LM on two slices (one slice stays), the loss going down on
    # one device (on eight stays)
    "tests/passes/test_scatter_adds_as_selects.py::test_a_language_model_trains_to_the_numbers_of_one_device[False]",
    "tests/test_parameter_sharding.py::test_scanned_lm_with_clipped_adamw_matches_one_device[tpu-2xv5e-4]",
    "tests/test_equivalence.py::test_loss_goes_down[OneDeviceStrategy]",
    # 11-12 s each, with kin in `make test`: a save killed midway (the other checkpoint
    # cases stay), `aot` on `python -c` (`aot` on a script stays)
    "tests/runtime/test_checkpoint.py::test_a_save_killed_midway_never_becomes_the_latest",
    "tests/test_aot_command.py::test_aot_runs_python_dash_c_and_does_not_reprint_an_earlier_runs_summary",
    # 7-10 s each, with kin in `make test`, once a fresh clone's `make test` took 415 s:
    # nnx split/merge with batch norm (the other nnx cases stay), two passes' fuzzing alone
    # (the default pipeline's and the other passes' stay), the torch CNN with SyncBatchNorm
    # (without it, and on TPU, stay)
    "tests/frameworks/test_flax_nnx.py::test_nnx_split_merge_with_batchnorm_dropout_and_rngs",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[reassociate-all-reduces]",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[hoist-all-reduces]",
    "tests/torch_models/test_train.py::test_cnn_with_batchnorm_and_sgd_momentum_matches_eager_torch[mirrored-syncbn]",
    # 8-16 s each, with kin in `make test`, once CI's `make test` took 419 s: each pass
    # alone on the MLP (the fuzzed pipelines stay), the torch CNN under Mirrored (on TPU
    # stays), two fuzzed strategies (the fuzzed passes and Central Storage's own cases
    # stay), a table smaller than its lookups (looked up in place stays)
    "tests/passes/test_pass_numerics.py::test_each_pass_preserves_the_numbers[mlp]",
    "tests/torch_models/test_train.py::test_cnn_with_batchnorm_and_sgd_momentum_matches_eager_torch[mirrored]",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[central-storage]",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[tpu-decomposed]",
    "tests/test_lookups_in_place.py::test_a_table_smaller_than_its_lookups_is_gathered_and_reduce_scattered_as_before",
    # 8 s, added when `make test` read 388.7 s on a fresh clone (2026-11-28): a remat
    # policy under parameter sharding (full remat's cases stay)
    "tests/test_parameter_sharding.py::test_a_remat_policy_that_keeps_the_matmuls_reaches_the_program_and_keeps_the_numbers",
    # checkpoint faults with real processes (2026-11-28): `make test` keeps two kills of
    # each kind, the race of a retried save, two writers and a reader beside a writer
    # that deletes; the repeats that show the rate is zero run here
    "tests/runtime/test_checkpoint_processes.py::test_a_kill_during_max_to_keep_deletion_never_leaves_a_listed_damaged_step[repeat",
    "tests/runtime/test_checkpoint_processes.py::test_a_kill_during_an_overwrite_leaves_the_latest_step_whole[repeat",
    "tests/runtime/test_checkpoint_processes.py::test_a_kill_during_asynchronous_saves_with_max_to_keep_never_leaves_a_listed_damaged_step[repeat",
    "tests/runtime/test_checkpoint_processes.py::test_a_retried_save_after_a_full_disk_commits_and_the_process_exits[repeat",
    "tests/runtime/test_checkpoint_processes.py::test_a_retried_save_after_a_full_disk_commits_and_the_process_exits[run0-beside]",
    "tests/runtime/test_checkpoint_processes.py::test_a_retried_save_after_a_full_disk_commits_and_the_process_exits[run0-close-first]",
    "tests/runtime/test_checkpoint_processes.py::test_a_reader_beside_a_writer_never_deletes_and_always_reads_whole_steps[100]",
    # 5-25 s each, with kin in `make test` (2026-11-28): the guarantee against jax.jit on
    # a DGX node (its two v5e-16 cases stay), the opt-in numerics check on entering NaNs
    # (jax_debug_nans' stays), aot killed with SIGKILL and aot's progress lines (SIGTERM's
    # and the timeout's stay), the plan command (strategy.plan stays)
    "tests/test_never_worse_than_jit.py::test_a_step_is_never_worse_than_plain_jit[flax-cnn-dgx-h100]",
    "tests/test_debug_nans.py::test_a_nan_that_enters_with_the_arguments_is_named_by_its_argument[check_numerics]",
    "tests/test_aot_command.py::test_sigkill_to_aot_ends_the_users_script_too",
    "tests/test_aot_command.py::test_aot_says_what_the_script_is_doing_while_it_waits",
    "tests/test_planner.py::test_the_command_line_plans_a_scripts_first_step",
    # 10-22 s each, once `make test` read 385.5 and 390.4 s (2026-11-29): the planner's
    # remat policies (its split, stages and cached cases stay), the remat-scanned LM in
    # stages (the flax and plain scanned models stay), a reader beside a writer 3 times
    # (its other checkpoint-process cases stay)
    "tests/test_planner.py::test_remat_policies_are_tried_where_the_steps_blocks_have_none",
    "tests/test_planner.py::test_schedules_are_tried_on_the_best_configuration_with_stages",
    "tests/test_pipeline_stages.py::test_a_remat_scanned_language_model_trains_as_one_device_does",
    "tests/runtime/test_checkpoint_processes.py::test_a_reader_beside_a_writer_never_deletes_and_always_reads_whole_steps[3]",
    # 5-8 s each, once `make test` read 382.4 s (2026-11-30): a float64 step and
    # axis_name with sharded stages (stages' own float32 and replica-axis cases stay)
    "tests/test_pipeline_stages.py::test_a_float64_step_keeps_its_float64_loss_with_stages",
    "tests/test_pipeline_stages_sharded.py::test_sharded_stages_with_an_axis_name_train_as_one_device_does",
    # 5-23 s each, once `make test` read 422.3 and 443.4 s on this machine's 2 cores
    # (2026-11-30), each with kin that stays: the verdict's cache (the guarantee's own
    # cases stay), the TPU gather inside the loop (the CPU ones stay), a second checkpoint
    # writer (the reader and retry cases stay), nn.scan's gelu case, the v5e-8 clipped
    # adamw LM (the CPU one stays), a NaN the step makes (an entering one stays), GPipe's
    # flax-docs step (1F1B's stays), Mirrored's loss curve, the NNX head's dropout, the
    # drawn loss's central differences and the layers' draws under interleaving (each
    # microbatch's own draws in the layers stay), the planner's
    # stages, a Keras text transformer's declared ops, a stack whose layer axis is not first
    "tests/test_never_worse_than_jit.py::test_the_verdict_is_cached_by_the_programs_fingerprint_and_said",
    "tests/test_parameter_sharding_state.py::test_the_tpu_compiler_gathers_one_layer_at_a_time_inside_the_loop",
    "tests/runtime/test_checkpoint_processes.py::test_a_second_writer_is_refused_naming_the_first_and_no_step_mixes",
    "tests/test_pipeline_stages.py::test_a_flax_model_scanned_with_nn_scan_trains_unchanged[gelu]",
    "tests/test_parameter_sharding.py::test_scanned_lm_with_clipped_adamw_matches_one_device[tpu-v5e-8]",
    "tests/test_debug_nans.py::test_a_nan_the_step_makes_is_jaxs_error_or_the_checks_naming_the_output",
    "tests/test_pipeline_stages.py::test_a_flax_step_that_closes_over_its_batch_and_returns_metrics[gpipe]",
    "tests/test_equivalence.py::test_loss_goes_down[MirroredStrategy]",
    "tests/test_pipeline_stages_nnx.py::test_a_head_that_draws_dropout_trains_in_stages_each_microbatch_drawing_its_own_mask",
    "tests/test_pipeline_draws.py::test_the_gradient_is_the_drawn_losss_by_central_differences",
    "tests/test_pipeline_stages_nnx.py::test_the_layers_draws_are_the_same_whatever_the_schedule",
    "tests/test_planner.py::test_stages_across_slices_are_planned_where_replicated_state_does_not_fit",
    "tests/passes/test_declared_ops.py::test_every_op_of_a_keras_fit_is_declared[text_transformer]",
    "tests/test_parameter_sharding.py::test_a_stack_whose_layer_axis_is_not_its_first_is_gathered_a_layer_at_a_time",
    # 6-10 s each, once `make test` read 437.7 and 451.4 s with the above moved (same
    # day), each with kin that stays: NNX layers' dropout (the guide's NNX model and the
    # plain loss's own draws stay), the next layer's prefetch, three of the five fuzzed
    # pipelines, the torch CNN on a TPU topology, the selects on one of two settings, the
    # ring spelling of a sum, a stack's split moments, a feature-split table on v5e-8, the
    # remat policy's memory, checkpoints between replica counts
    "tests/test_pipeline_stages_nnx.py::test_layers_that_draw_dropout_train_in_stages_their_streams_advanced_as_nnx_jit_does",
    "tests/test_parameter_sharding.py::test_prefetching_the_next_layer_keeps_the_numbers",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[shard-weight-updates]",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[fold-invariant-reductions]",
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[schedule-all-reduces{force=pipeline}]",
    "tests/torch_models/test_train.py::test_cnn_with_batchnorm_and_sgd_momentum_matches_eager_torch[tpu]",
    "tests/passes/test_scatter_adds_as_selects.py::test_a_language_model_trains_to_the_numbers_of_one_device[True]",
    "tests/test_collective_spellings.py::test_each_spelling_keeps_every_chips_part_of_the_sum[ring]",
    "tests/test_parameter_sharding.py::test_a_stacks_moments_are_split_where_the_stack_is_when_its_layers_divide",
    "tests/test_lookups_in_place.py::test_a_table_split_on_its_features_is_looked_up_where_it_lies[tpu-v5e-8]",
    "tests/test_remat_policy.py::test_keeping_more_for_the_backward_pass_costs_memory_on_the_chip",
    "tests/test_weight_update_sharding.py::test_checkpoints_move_between_replica_counts_and_the_replicated_update",
    # 5-7 s each, once a fresh clone's `make test` read 406.5 s with the above moved (same
    # day; the same suite read 437.7 and 451.4 s in two runs): casts sunk below a lookup
    # (the selects' case stays), BERT's declared ops (a CNN's stay), bytes per device
    # falling to 1/N (the split state's tests stay), splash attention's TPU report (its
    # training stays), ResNet-50's flops (the transformer's stay)
    "tests/passes/test_sink_casts_below_lookups.py::test_a_step_whose_loss_gathers_cast_logits_trains_to_the_same_numbers",
    "tests/passes/test_declared_ops.py::test_every_op_of_a_transformers_train_step_is_declared[bert]",
    "tests/test_parameter_sharding_state.py::test_parameter_and_optimizer_bytes_per_device_fall_to_one_over_n",
    "tests/test_custom_kernels.py::test_splash_attention_compiles_for_a_tpu_slice_and_the_report_names_its_kernels[None]",
    "tests/test_model_flops.py::test_resnet50_flops_are_the_compiled_forwards_three_times",
    # 4-8 s each, once the same fresh clone's `make test` read 420.3 s with the above moved
    # (this machine's runs vary by 30 s), each with kin that stays: a fourth fuzzed
    # pipeline (the default's stays), the ring spelling of a gather, one of the annotated
    # NNX model's settings, haiku's LSTM (its BatchNorm stays), GPipe's jax gradients at
    # S=2 (the other schedules' stay), torch SGD against optax, a GPU program's inlined
    # calls, BatchNorm across emulated slices, 1F1B at S=4 with sharded parameters
    "tests/fuzz/test_differential.py::test_every_pipeline_gives_one_device_numbers[combine-all-reduces]",
    "tests/test_collective_spellings.py::test_each_spelling_gathers_every_chips_part_in_order[ring]",
    "tests/test_model_axis.py::test_an_annotated_nnx_model_trains_like_nnx_jit_and_stays_split[2-True]",
    "tests/frameworks/test_haiku.py::test_an_lstm_unrolled_from_a_zero_state_equals_jax_jit",
    "tests/passes/test_pipelined_gradients.py::test_each_schedule_gives_jax_gradients[gpipe-2-4-1]",
    "tests/torch_models/test_train.py::test_optax_optimizer_matches_torch_sgd",
    "tests/passes/test_called_functions.py::test_a_gpus_program_keeps_the_calls_inlined",
    "tests/passes/test_split_stacked_all_reduces.py::test_batch_norm_across_emulated_slices_trains_to_the_numbers_of_one_device",
    "tests/test_pipeline_stages_sharded.py::test_each_schedule_with_sharded_parameters_trains_as_one_device_does[1f1b-S4-M8]",
    # 2026-11-30: a step's metrics with stages at M=4 (M=2's stays)
    "tests/test_pipeline_metrics.py::test_metrics_over_the_batch_are_the_whole_batchs_as_without_stages[4]",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)

"""The one place that touches MXNet/Gluon private attributes (mxnet 1.9.1),
by concern: params.py, blocks.py, trainer.py (read accessors, and the few
writes Gluon offers no public way to make), arrays.py (bfloat16-safe
operators, copies and slices in C calls), invoke.py (operators through the C API,
no Python frame per call), executors.py (replicated graphs bound so that
each replica's operators are bulked), memory_plan.py (executors' memory next
to MKL-DNN), environment.py (the variables a bind reads, set without
adding or removing one while operators run), patches.py (the process-wide
patches, installed on first use).

Every helper names the 1.9.1 behaviour it relies on, so that a new MXNet
release is checked here and nowhere else. Other modules call these and
read or write no underscored attribute of an MXNet object; the package's
subclasses of Gluon classes (SyncBatchNorm, HostEmbedding) use their own
inherited state through ``self``, as Gluon's subclasses do (so does
``nn/embedding.py``'s PinnedParameter); ``checkpoint/trainer_state.py``
reaches the optimizer's update counts through ``trainer.py`` too.
"""
from .param_arrays import (has_data, is_deferred, is_row_sparse, has_sparse_grad, reduced_value,
                     load_init, grad_is_fresh, set_grad_fresh, mark_grads_fresh, set_grads_fresh,
                     grads_fresh, hidden_from_step, param_trainers, param_arrays_state,
                     grad_arrays, true_grad_req, replace_grads, param_trainer)
from .blocks import (structural_params, children, is_active_hybrid, has_forward_hooks,
                     own_call, call_with_kwargs, cached_graph_inputs, graph_input_format,
                     fits_graph_format, owns_param, replace_param, batchnorm_config, build_graph,
                     traced_graph,
                     graph_handle, flat_inputs, flat_inputs_all, nested_outputs,
                     nested_outputs_all, needs_grad, is_recorded, VariableMarker,
                     is_symbol_block, symbol_graph, set_symbol_graph)
from .trainer_hooks import (trainer_params, trainer_kvstore_ready, trainer_kvstore_config,
                      amp_loss_scaler, trainer_compression,
                      trainer_updates_on_kvstore, init_trainer_kvstore,
                      init_trainer_params, kvstore_barrier, free_kvstore, specialise, TrainerHooks,
                      MULTI_TENSOR_MAX, count_updates, lrs_and_wds, batched_pushpull)
from .trainer_hooks import (trainer_optimizer, trainer_device_ids, optimizer_index_dicts,
                      device_update_counts, use_device_update_counts)
from .arrays import (split_into, copy_into, signature, row_signature, copies, Copier, row_slices,
                     copy,
                     to_context, zero, add_into, load_operator_library)
from .invoke import op_params, prepared_op, invoke, invoke_each, executor_forward, quiet_bind
from .executors import bind_replicas, share_symbol
from .memory_plan import exact_size_plan
from .environment import add_variable
from .patches import (route_cached_op_calls, cached_op_route, unroute_cached_op_calls,
                      after_backward, after_backward_hook, remove_after_backward, route_backward,
                      backward_route, unroute_backward)

# A boundary, not an API: the package's modules call these by name.
__all__ = ['has_data', 'is_deferred', 'is_row_sparse', 'has_sparse_grad', 'reduced_value',
           'load_init', 'grad_is_fresh', 'set_grad_fresh', 'mark_grads_fresh', 'hidden_from_step',
           'param_trainers', 'param_arrays_state', 'structural_params', 'children',
           'is_active_hybrid', 'has_forward_hooks', 'own_call', 'call_with_kwargs',
           'cached_graph_inputs', 'graph_input_format', 'fits_graph_format', 'owns_param',
           'replace_param', 'batchnorm_config', 'build_graph', 'traced_graph', 'graph_handle',
           'flat_inputs',
           'nested_outputs', 'needs_grad', 'is_recorded', 'VariableMarker', 'trainer_params',
           'trainer_kvstore_ready',
           'trainer_kvstore_config', 'amp_loss_scaler', 'trainer_compression',
           'trainer_updates_on_kvstore',
           'init_trainer_kvstore', 'init_trainer_params', 'kvstore_barrier', 'free_kvstore',
           'specialise', 'split_into', 'copy', 'to_context', 'zero', 'add_into',
           'load_operator_library', 'route_cached_op_calls', 'cached_op_route',
           'unroute_cached_op_calls', 'after_backward', 'after_backward_hook',
           'remove_after_backward', 'set_grads_fresh', 'grads_fresh', 'flat_inputs_all',
           'nested_outputs_all', 'TrainerHooks', 'MULTI_TENSOR_MAX', 'count_updates', 'lrs_and_wds',
           'batched_pushpull', 'copy_into', 'signature', 'row_signature', 'copies', 'Copier',
           'row_slices',
           'op_params', 'prepared_op', 'invoke', 'invoke_each',
           'executor_forward', 'quiet_bind', 'add_variable', 'grad_arrays', 'true_grad_req',
           'replace_grads',
           'param_trainer', 'bind_replicas', 'share_symbol', 'exact_size_plan', 'is_symbol_block',
           'symbol_graph', 'set_symbol_graph', 'route_backward', 'backward_route',
           'unroute_backward']
__all__ += ['trainer_optimizer', 'trainer_device_ids', 'optimizer_index_dicts',
            'device_update_counts', 'use_device_update_counts']

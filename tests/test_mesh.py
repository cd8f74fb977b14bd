"""Mesh shapes from config, and the errors that say what to change."""

import jax
import pytest
from ml_collections import config_dict

from parallel import mesh as mesh_lib
from trainer.base.errors import UserError


def _mesh_config(data, fsdp=1, tensor=1, dcn_data=1, dcn_fsdp=1, expert=1, context=1):
  return config_dict.ConfigDict({'data': data, 'fsdp': fsdp, 'expert': expert, 'context': context, 'tensor': tensor,
                                 'dcn_data': dcn_data, 'dcn_fsdp': dcn_fsdp})


@pytest.mark.parametrize('sizes,expected', [
    ((-1, 1, 1), (8, 1, 1, 1, 1, 1)), ((2, -1, 1), (2, 4, 1, 1, 1, 1)), ((2, 2, -1), (2, 2, 1, 1, 1, 2)),
    ((1, 8, 1), (1, 8, 1, 1, 1, 1)), ((2, 1, 1, 1, 1, -1), (2, 1, 1, 4, 1, 1)), ((2, 1, 1, 1, 1, 1, -1), (2, 1, 1, 1, 4, 1))])
def test_resolve_shape_fills_one_axis(sizes, expected):
  assert mesh_lib.resolve_shape(_mesh_config(*sizes), 8) == expected


def test_a_mesh_config_from_before_the_expert_axis_has_expert_1():
  old = config_dict.ConfigDict({'data': 4, 'fsdp': 2, 'tensor': 1, 'dcn_data': 1, 'dcn_fsdp': 1})
  assert mesh_lib.resolve_shape(old, 8) == (4, 2, 1, 1, 1, 1)


def test_pipeline_axis_is_not_a_batch_axis_and_spans_slices():
  """mesh.pipeline sits after fsdp; mesh.dcn_pipeline repeats it across host groups (CPU devices have no slices)."""
  config = _mesh_config(2, 1, 1)
  config.pipeline, config.dcn_pipeline = 2, 2
  mesh = mesh_lib.build_mesh(config)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 1, 'pipeline': 4, 'expert': 1, 'context': 1, 'tensor': 1}
  assert mesh_lib.data_parallel_size(mesh) == 2
  assert mesh_lib.dcn_shape(config, 8) == (1, 1, 2, 1, 1, 1)


def test_expert_axis_splits_the_batch_too():
  mesh = mesh_lib.build_mesh(_mesh_config(2, 1, 1, expert=4))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 1, 'pipeline': 1, 'expert': 4, 'context': 1, 'tensor': 1}
  assert mesh_lib.data_parallel_size(mesh) == 8


def test_two_fills_is_an_error_naming_both():
  with pytest.raises(UserError, match=r'mesh.data and mesh.fsdp are both -1'):
    mesh_lib.resolve_shape(_mesh_config(-1, -1), 8)


def test_wrong_product_suggests_shapes_that_fit():
  with pytest.raises(UserError, match=r'needs 6 devices but 8 are available.*data=8,fsdp=1,tensor=1') as fewer:
    mesh_lib.resolve_shape(_mesh_config(3, 2), 8)
  assert 'xla_force_host_platform_device_count' not in str(fewer.value)  # Too few asked for: faking cannot help.


def test_too_many_devices_on_cpu_names_the_flag_that_fakes_them():
  with pytest.raises(UserError) as more:
    mesh_lib.resolve_shape(_mesh_config(2, 2), 1)
  assert str(more.value).endswith('On CPU, prefix the command with '
                                  'XLA_FLAGS=--xla_force_host_platform_device_count=4 to run 4 devices.')


def test_fill_that_cannot_divide():
  with pytest.raises(UserError, match=r'fixed axes use 3, which does not divide 8'):
    mesh_lib.resolve_shape(_mesh_config(-1, 3), 8)


def test_build_mesh_uses_all_devices_with_auto_axes():
  mesh = mesh_lib.build_mesh(_mesh_config(2, -1))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
  assert mesh.size == len(jax.devices()) == 8


def test_batch_size_error_names_both_numbers_and_nearest_sizes():
  mesh = mesh_lib.build_mesh(_mesh_config(-1))
  with pytest.raises(UserError) as err:
    mesh_lib.check_batch_size(12, mesh, process_count=1)
  message = str(err.value)
  assert 'train.batch_size=12' in message and '8 data-parallel devices' in message
  assert 'Nearest valid batch sizes: 8 or 16' in message
  mesh_lib.check_batch_size(16, mesh, process_count=1)


def test_dcn_axes_multiply_per_slice_sizes_host_major():
  """dcn_fsdp=2 over 8 devices: two slices of 4, each (data=2, fsdp=2); slice 0 is devices 0-3."""
  mesh = mesh_lib.build_mesh(_mesh_config(2, 2, 1, dcn_fsdp=2))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  ids = [[d.id for d in row] for row in mesh.devices[:, :, 0, 0, 0, 0]]
  assert ids == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_dcn_fill_uses_devices_per_slice():
  mesh = mesh_lib.build_mesh(_mesh_config(-1, 1, 2, dcn_data=2))
  assert dict(mesh.shape) == {'data': 4, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 2}


def test_dcn_that_does_not_divide_devices():
  with pytest.raises(UserError, match=r'mesh.dcn_data=3 x mesh.dcn_fsdp=1 x mesh.dcn_pipeline=1 = 3 slices does not divide the 8'):
    mesh_lib.build_mesh(_mesh_config(-1, dcn_data=3))


def test_context_axis_sits_between_fsdp_and_tensor_and_can_fill():
  """mesh.context splits each row's tokens; -1 on it takes the devices the others leave."""
  mesh = mesh_lib.build_mesh(_mesh_config(2, 1, 1, context=-1))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 4, 'tensor': 1}
  with pytest.raises(UserError, match=r'needs 6 devices.*context='):
    mesh_lib.resolve_shape(_mesh_config(3, 1, 1, context=2), 8)

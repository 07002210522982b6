"""Checkpoint metadata written with plain integers under NumPy 2.

[Note: nanotron 0.4 with NumPy 2] nanotron writes a checkpoint's tensor metadata with
`str()` of its slice bounds and shapes, which are NumPy integers where they were computed
with NumPy; under NumPy 2 `str(np.int64(64))` is "np.int64(64)", which nanotron's own
loader cannot parse back (`int("np.int64(64)")`), so a checkpoint nanotron 0.4 saves
cannot be loaded (resuming, `init_method: {path: ...}`). `TensorMetadata.to_str_dict`
is wrapped to write plain integers, as under NumPy 1; a checkpoint already written with
NumPy's spelling still needs to be saved again.
"""

from __future__ import annotations

import dataclasses

import nanotron.parallel.parameters as nanotron_parameters
import nanotron.serialize.metadata as nanotron_metadata

from integration.nanotron.patches.base import rebind


def to_str_dict(self):
    """nanotron's `TensorMetadata.to_str_dict` of the same metadata with plain ints."""
    pairs = tuple(nanotron_parameters.SlicesPair(_plain_slices(p.local_slices), _plain_slices(p.global_slices))
                  for p in self.local_global_slices_pairs)
    plain = dataclasses.replace(self, local_global_slices_pairs=pairs,
                                unsharded_shape=tuple(int(n) for n in self.unsharded_shape))
    return to_str_dict.__pipeschedule_original__(plain)


def _plain(bound):
    return None if bound is None else int(bound)


def _plain_slices(slices):
    return tuple(slice(_plain(s.start), _plain(s.stop), _plain(s.step)) for s in slices)


METADATA_INTEGERS = rebind(nanotron_metadata.TensorMetadata, "to_str_dict", to_str_dict, parameters=("self",),
                           why="checkpoint metadata in plain ints under NumPy 2 ([Note: nanotron 0.4 with NumPy 2])")
PATCHES = (METADATA_INTEGERS,)

__all__ = ["METADATA_INTEGERS", "PATCHES", "to_str_dict"]

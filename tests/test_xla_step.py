"""mk.measure.xla_step: the compiled XLA decode step read instruction by instruction."""

import pytest

import mk
from mk.measure import xla_step
from mk.model.quant import stored_bytes

HLO = """HloModule m

%fused_computation.1 (p: bf16[8,128]) -> f32[8,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  ROOT %c = f32[8,128]{1,0} convert(%p)
}

ENTRY %main.3 (a: bf16[8,128], w: bf16[128,256]) -> f32[8,256] {
  %a = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(1)
  %copy-start.1 = (bf16[128,256]{1,0:T(8,128)(2,1)S(1)}, bf16[128,256]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %copy-done.1 = bf16[128,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  %fusion.1 = f32[8,128]{1,0:T(8,128)S(1)} fusion(%a), kind=kLoop, calls=%fused_computation.1
  ROOT %dot_fusion = f32[8,256]{1,0:T(8,128)} fusion(%fusion.1, %copy-done.1), kind=kOutput, calls=%fused_computation.1
}
"""


def test_parse_entry_counts_each_instruction_with_its_bytes_and_memory_space():
    ops = {o.name: o for o in xla_step.parse_entry(HLO)}
    assert set(ops) == {"a", "w", "copy-start.1", "copy-done.1", "fusion.1", "dot_fusion"}
    assert ops["fusion.1"].fusion_kind == "kLoop" and ops["fusion.1"].operand_bytes == 8 * 128 * 2
    assert ops["fusion.1"].result_bytes == 8 * 128 * 4 and ops["fusion.1"].result_hbm_bytes == 0
    dot = ops["dot_fusion"]  # reads the VMEM copy of w and fusion.1's result, writes to HBM
    assert dot.operand_bytes == 8 * 128 * 4 + 128 * 256 * 2
    assert dot.result_hbm_bytes == dot.result_bytes == 8 * 256 * 4
    # the control: the same text with the result in VMEM (S(1)) writes nothing to HBM
    vmem = HLO.replace("f32[8,256]{1,0:T(8,128)} fusion", "f32[8,256]{1,0:T(8,128)S(1)} fusion")
    assert {o.name: o for o in xla_step.parse_entry(vmem)}["dot_fusion"].result_hbm_bytes == 0


def test_tiny_xla_step_compiles_for_v6e_into_many_fusions_and_refuses_a_gpu():
    step = xla_step.compile_step(mk.preset("tiny"), "v6e", context=256)
    assert step.layers == 2 and step.fusions > 10 * step.layers
    assert step.fusion_bytes > stored_bytes(mk.preset("tiny"))  # every weight is read
    with pytest.raises(ValueError, match="chip='h200' is a gpu"):
        xla_step.compile_step(mk.preset("tiny"), "h200")

"""bench/pdl_ptx.py: the compile checks' test that a PDL kernel touches no memory before
``griddepcontrol.wait``, on PTX fragments shaped like Triton's sm_90 output."""

from bench.pdl_ptx import pdl_order_error

HEAD = """.visible .entry k(
\t.param .u64 .ptr .global .align 16 k_param_0
)
{
\tld.param.u64 \t%rd1, [k_param_0];
\tmov.u32 \t%r1, %ctaid.x;
\t// begin inline asm
\tprefetch.global.L2 [%rd5];
\t// end inline asm
"""
WAIT = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n"
BODY = (
    "\tld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ];\n\tst.global.b16 [%rd2], %rs1;\n}\n"
)


def test_wait_before_every_access_passes():
    assert pdl_order_error(HEAD + WAIT + BODY, True) is None


def test_no_wait_fails_only_a_pdl_kernel():
    assert pdl_order_error(HEAD + BODY, False) is None
    assert "no griddepcontrol.wait" in pdl_order_error(HEAD + BODY, True)


def test_accesses_before_the_wait_are_named():
    for early in (
        "\tld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ];\n",
        "\t@%p1 st.global.b32 [%rd3], %r9;\n",
        "\tatom.global.gpu.acq_rel.add.u32 %r7, [%rd4], 1;\n",
        "\tbar.sync \t0;\n",
        "\tcp.async.cg.shared.global [ %r10 + 0 ], [ %rd6 + 0 ], 0x10, %r11;\n",
        "\t@!%p2 ld.shared.b32 %r12, [%r13];\n",
    ):
        err = pdl_order_error(HEAD + early + WAIT + BODY, True)
        assert err is not None and early.strip() in err, early

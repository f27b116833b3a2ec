from tests.test_hostcalls import *  # noqa

def test_probe(h):
    for name, setup, model in [
        ("inf_iter", [('{"key":"max_iterations","value":1e400}')], "replay/plain"),
        ("backend_list", [('{"key":"backend","value":[1]}')], "replay/plain"),
        ("badreq", [], "replay/bad_request"),
        ("temp_nan", [('{"key":"temperature","value":NaN}')], "replay/plain"),
    ]:
        p = Program()
        s = p.call("cchat_create")
        sets = [with_arg(p, "cchat_ctl", Ref(s), SET_PARAM, a) for a in setup]
        write_msg(p, Ref(s), "user", "probe " + name)
        r = p.call("cchat_send", Ref(s), METRICS)
        body = with_out(p, "cchat_recv", Ref(r), cap=4096)
        m = with_out(p, "cchat_ctl", Ref(r), GET_METRICS, cap=4096)
        ran = h.run(p, model=model, deadline_s=15, check=False)
        print(name, ran.elapsed_s, ran.outcome.exit_code, ran.outcome.error_code, ran.outcome.error)
        if ran.outcome.stdout:
            print("  ", [ran.r(c) for c in sets], ran.r(r), ran.out(body.ptr, body.cell), ran.out(m.ptr, m.cell))
    p = Program()
    s = p.call("cchat_create")
    write_msg(p, Ref(s), "user", "héllo ✓ wörld")
    r = p.call("cchat_send", Ref(s), 0)
    body = with_out(p, "cchat_recv", Ref(r), cap=4096)
    e = p.call("spear_epoll_create")
    tiny = with_out(p, "spear_epoll_wait", Ref(e), cap=4, size=8, tail=(0,))
    ran = h.run(p)
    print(ran.out(body.ptr, body.cell))
    print(ran.out(body.ptr, body.cell) == echo_body("héllo ✓ wörld"))
    print("tiny", ran.r(tiny.call), ran.dump.u32(tiny.cell))
    assert 0

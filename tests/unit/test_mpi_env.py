"""pycomm.mpi_env: OMPI_MCA_osc is filled in on one host only and never over the user's setting."""
from pycomm.mpi_env import apply_defaults, osc_default


def test_singleton_gets_the_default():
    env = {}
    apply_defaults(env)
    assert env == {"OMPI_MCA_osc": "^ucx"}


def test_open_mpi_one_host_gets_the_default():
    assert osc_default({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == "^ucx"


def test_open_mpi_several_hosts_left_alone():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    apply_defaults(env)
    assert "OMPI_MCA_osc" not in env


def test_user_choice_wins():
    for value in ("ucx", "", "sm,rdma"):
        env = {"OMPI_MCA_osc": value, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
        apply_defaults(env)
        assert env["OMPI_MCA_osc"] == value


def test_other_launchers_left_alone():
    for key in ("PMI_RANK", "PMIX_RANK", "HYDRA_CONTROL_FD"):
        assert osc_default({key: "0"}) is None

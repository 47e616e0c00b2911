"""pytest_files: one py_test per pytest file, run through tests/bazel_pytest.py."""

def pytest_files(name, srcs, helpers = [], data = [], manual = []):
    """Declares `<path without .py>` py_tests for `srcs` and a test_suite `name` of them."""
    tests = []
    for src in srcs:
        test_name = src[:-len(".py")]
        native.py_test(
            name = test_name,
            srcs = ["bazel_pytest.py", src] + helpers,
            main = "bazel_pytest.py",
            legacy_create_init = False,
            args = ["$(location %s)" % src],
            data = data,
            deps = ["//:xlaserve"],
            size = "enormous" if src in manual else "large",
            tags = ["manual", "exclusive"] if src in manual else [],
        )
        tests.append(":" + test_name)
    native.test_suite(name = name, tests = tests)

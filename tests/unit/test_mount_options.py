"""Cloud Storage FUSE mount options: one table of what is accepted with which value, what is
refused with which words, and the same answer from the provider's rules
(:mod:`airflow_gpu_resilience.mount_options`, the job spec) and the emulator's own
(:mod:`cloud_run_emulator.mount_options`: its request validation and its FUSE mounts, which also
accept the emulator's own ``x-emulator-strict``; Cloud Run's rules, and so the provider's, refuse
it as an unknown option)."""

from __future__ import annotations

import pytest

import cloud_run_emulator.mount_options as emulator_rules
from airflow_gpu_resilience import mount_options as provider_rules

#: The two rule tables, the provider's and the emulator's: every verdict must be the same.
RULES = pytest.mark.parametrize("rules", [provider_rules, emulator_rules], ids=["provider", "emulator"])

ACCEPTED = [
    (["implicit-dirs"], {"implicit-dirs": True}),
    (["implicit-dirs=false"], {"implicit-dirs": False}),
    (["enable-streaming-writes=true"], {"enable-streaming-writes": True}),
    (["rename-dir-limit=0"], {"rename-dir-limit": 0}),
    (["rename-dir-limit=100"], {"rename-dir-limit": 100}),
    (["write-global-max-blocks=-1"], {"write-global-max-blocks": -1}),  # gcsfuse: -1 is unlimited
    (["metadata-cache-ttl-secs=-1"], {"metadata-cache-ttl-secs": -1}),
    (["stat-cache-max-size-mb=-1", "type-cache-max-size-mb=32"], {"stat-cache-max-size-mb": -1,
                                                                  "type-cache-max-size-mb": 32}),
    (["file-mode=644", "dir-mode=0755"], {"file-mode": 0o644, "dir-mode": 0o755}),
    (["file-mode=777"], {"file-mode": 0o777}),
    (["file-mode=1777"], {"file-mode": 0o1777}),  # gcsfuse reads the mode in base 8, special bits too
    (["uid=0", "gid=4294967294"], {"uid": 0, "gid": 4294967294}),
    (["uid=-1", "gid=-1"], {"uid": -1, "gid": -1}),  # gcsfuse's default: the mounting user
    (["implicit-dirs=True", "enable-streaming-writes=0"], {"implicit-dirs": True, "enable-streaming-writes": False}),
    (["implicit-dirs=t"], {"implicit-dirs": True}),
    (["metadata-cache-ttl-secs=9223372036"], {"metadata-cache-ttl-secs": 9223372036}),
    (["log-severity=WARNING"], {"log-severity": "warning"}),
    (["log-severity=off"], {"log-severity": "off"}),
    (["only-dir=runs/a/"], {"only-dir": "runs/a"}),
    (["max-conns-per-host=0"], {"max-conns-per-host": 0}),
    ([], {}),
    (None, {}),
]

REFUSED = [
    # (options, words in the one error)
    (["--implicit-dirs"], "mount_options[0]: '--implicit-dirs' must be written without the leading '--'"),
    (["cache-all"], "is not a Cloud Storage FUSE option Cloud Run accepts; allowed: dir-mode, "),
    ([7], "mount_options[0]: 7 must be a string"),
    (["implicit-dirs=yes"], "takes no value, or =true / =false"),
    (["implicit-dirs=tRuE"], "takes no value, or =true / =false"),  # ParseBool's spellings only
    (["rename-dir-limit"], "needs a value, e.g. rename-dir-limit=100"),
    (["rename-dir-limit=x"], "needs a non-negative integer in decimal digits"),
    (["rename-dir-limit=-1"], "needs a non-negative integer"),  # -1 is only "unlimited" for limits
    (["rename-dir-limit= 5"], "needs a non-negative integer"),
    (["rename-dir-limit=+5"], "needs a non-negative integer"),
    (["rename-dir-limit=5_0"], "needs a non-negative integer"),
    (["rename-dir-limit=\u0665"], "needs a non-negative integer"),  # an Arabic-Indic five
    (["rename-dir-limit=-0"], "needs a non-negative integer"),
    (["rename-dir-limit=010"], "without leading zeros"),  # gcsfuse's parser: octal 8, not 10
    (["metadata-cache-ttl-secs=9223372037"], "at most 9223372036"),
    (["kernel-list-cache-ttl-secs=99999999999"], "at most 9223372036"),
    (["stat-cache-max-size-mb=17592186044416"], "at most 17592186044415"),
    (["rename-dir-limit=9223372036854775808"], "at most 9223372036854775807"),
    (["write-global-max-blocks=-2"], "needs -1 (unlimited) or a non-negative integer"),
    (["uid=99999999999"], "at most 4294967294"),
    (["gid=-2"], "needs -1 (the mounting user) or a non-negative integer"),
    (["file-mode=9"], "needs an octal file mode from 0 to 7777"),
    (["file-mode=17777"], "needs an octal file mode from 0 to 7777"),
    (["dir-mode=0o755"], "needs an octal file mode from 0 to 7777"),
    (["log-severity=loud"], "needs one of trace, debug, info, warning, error, off"),
    (["log-severity="], "needs a value"),
    (["only-dir=/abs"], "needs a folder of the bucket relative to its root"),
    (["only-dir=a/../b"], "needs a folder of the bucket relative to its root"),
    (["only-dir=a//b"], "needs a folder of the bucket relative to its root"),
    (["only-dir=a,b"], "needs a folder name without commas, white space or control characters"),
    (["only-dir=a b"], "needs a folder name without commas"),
    (["only-dir=a\tb"], "needs a folder name without commas"),
    (["only-dir=a\u2028b"], "needs a folder name without commas"),
    (["only-dir=a\u202eb"], "needs a folder name without commas"),
    (["only-dir=" + "a" * 1025], "at most 1024 bytes"),
    (["implicit-dirs", "rename-dir-limit=1", "implicit-dirs=true"],
     "mount_options[2]: 'implicit-dirs=true' repeats implicit-dirs (already mount_options[0]); give each option once"),
    (["rename-dir-limit=1", "rename-dir-limit=5"], "repeats rename-dir-limit"),
    (["x-emulator-strict"], "mount_options[0]: 'x-emulator-strict' is not a Cloud Storage FUSE option Cloud Run "
                            "accepts; allowed: dir-mode, "),
]


@RULES
@pytest.mark.parametrize(("options", "expected"), ACCEPTED)
def test_accepted_options_and_their_values(options, expected, rules):
    assert rules.parse_mount_options(options) == expected


@pytest.mark.parametrize(("options", "expected"), ACCEPTED)
def test_the_emulators_requests_accept_cloud_runs_options_alike(options, expected):
    assert emulator_rules.parse_mount_options(options, emulator=True) == expected


@RULES
@pytest.mark.parametrize(("options", "says"), REFUSED)
def test_refused_options_get_one_error_naming_the_field_and_the_allowed_values(options, says, rules):
    with pytest.raises(ValueError) as err:
        rules.parse_mount_options(options)
    assert says in str(err.value)
    assert str(err.value).startswith("mount_options[")


def test_the_emulator_alone_accepts_its_strict_option_and_names_its_request_field():
    assert emulator_rules.parse_mount_options(["x-emulator-strict"], emulator=True) == {"x-emulator-strict": True}
    assert not hasattr(provider_rules, "EMULATOR_MOUNT_OPTIONS")  # the provider knows Cloud Run's options only
    field = "template.template.volumes[0].gcs.mount_options"
    with pytest.raises(ValueError, match=r"^template.template.volumes\[0\].gcs.mount_options\[0\]: 'log-severity=x'"):
        emulator_rules.parse_mount_options(["log-severity=x"], field, emulator=True)


@pytest.mark.parametrize(("options", "expected"), ACCEPTED + [(o, None) for o, _ in REFUSED])
def test_the_job_spec_and_the_emulator_volumes_agree(options, expected, tmp_path):
    """Every option list gets the same verdict from GpuJobSpec and the emulator's volumes
    (VolumeMounts.local_dir, before anything is mounted), but for the emulator's own option."""
    from cloud_run_emulator.gcsfuse import VolumeMounts
    from airflow_gpu_resilience.job_spec import GpuJobSpec

    verdicts = []
    spec = dict(name="j", image="us-docker.pkg.dev/p/r/i:1", checkpoint_bucket="ckpt-bucket")
    for check in (lambda: GpuJobSpec(**spec, mount_options=list(options or ())),
                  lambda: VolumeMounts(tmp_path, lambda b: tmp_path / b, mode="folder").local_dir("b", options)):
        try:
            check()
            verdicts.append(True)
        except ValueError:
            verdicts.append(False)
    emulator_only = options is not None and "x-emulator-strict" in options
    assert verdicts == [expected is not None, expected is not None or emulator_only]


def test_options_with_one_meaning_share_one_mount_key():
    """The emulator's mounts: one FUSE mount per meaning of the options."""
    key, parse = emulator_rules.mount_key, emulator_rules.parse_mount_options
    assert key(parse(["implicit-dirs", "log-severity=INFO"])) == key(parse(["log-severity=info", "implicit-dirs=true"]))
    assert key(parse(["implicit-dirs=false"])) != key(parse(["implicit-dirs"]))


@RULES
@pytest.mark.parametrize("options", ["implicit-dirs", b"implicit-dirs", {"implicit-dirs": True}])
def test_a_single_string_or_a_mapping_is_not_walked_as_a_list(options, rules):
    with pytest.raises(ValueError, match=r"^mount_options=.* must be a list of strings"):
        rules.parse_mount_options(options)

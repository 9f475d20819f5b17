"""A study's preparation outputs stay inside the study's directory: the driver removes a stale one with rmtree, so
the plan refuses an absolute path or one that climbs out, and the removal itself refuses a path that leads out."""

import json

import pytest


@pytest.mark.parametrize("output", ["/tmp/elsewhere", "../outside", "prep/../../up", ".", ""])
def test_prep_outputs_outside_the_study_directory_are_refused(output, tmp_path):
    from pretrain.study.outputs import remove_output
    from pretrain.study.plan import StudyError, load_study

    study = tmp_path / "s.yaml"
    study.write_text(f"name: s\nprep:\n  - {{name: tok, output: {json.dumps(output)}, command: [echo]}}\n"
                     "arms:\n  - {name: a, config: configs/quickstart.yaml, seeds: [1]}\n")
    with pytest.raises(StudyError, match="must be a path inside the study's directory"):
        load_study(study)
    victim = tmp_path / "victim"
    victim.mkdir()
    link = tmp_path / "out" / "prep"
    link.parent.mkdir()
    link.symlink_to(victim)  # a path inside the study directory that leads out of it
    with pytest.raises(StudyError, match="not inside the study's directory"):
        remove_output(link / "x", tmp_path / "out")
    assert victim.is_dir()

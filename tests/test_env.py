from nbtrain.notebook.ipython.env import QUIRKS, environment


def test_platforms_are_told_apart_by_their_own_markers():
    assert environment({"COLAB_RELEASE_TAG": "release-colab"}, {}) == "colab"
    assert environment({}, {"google.colab": object()}) == "colab"
    assert environment({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}) == "kaggle"
    assert environment({"VSCODE_PID": "123"}, {}) == "vscode"
    assert environment({}, {}) == "terminal"  # pytest runs outside Jupyter
    assert set(QUIRKS) == {"colab", "kaggle", "vscode", "jupyter", "terminal"}

"""Images listed in a labels file: `data.format: csv`.

The layout of most datasets that are not class folders (a Kaggle competition's `train.csv`, Hugging Face's
`imagefolder` with its `metadata.csv` or `metadata.jsonl`, a labelling tool's export): `DIR/<split>.csv` for each
split (or `DIR/<split>/metadata.csv`, Hugging Face's, its paths starting from the split's folder), whose header
names the image column (`file_name`, `image`, `filename`, `path` or `file`) and the label column (`label`, `class`,
`category`), separated by commas (or semicolons or tabs); other columns are left alone. A JSON Lines file
(`<split>.jsonl`, `<split>/metadata.jsonl`) holds one object per image with the same keys. Image paths are relative
to `DIR` (`images/0001.jpg`), in a bucket too.

Labels are class names. They index the sorted names (in number order where every name is an integer, so labels
0..N-1 keep their numbers) of every label in the training and validation files, both read whichever split a command
lists, so a run and its evaluation give each index one meaning; a `classes.txt` in `DIR` (one name per line) fixes
the order instead, and must hold every label (or, where labels are integers, as many lines as they index). Every
image listed must be there: `DIR`'s folders are listed once (a bucket's concurrently), and one line names the first
image missing and how many are. So does one line for a row without a label, a path that leaves `DIR`, or an image
TensorFlow does not decode.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import posixpath

from tfdp.data.layouts import (IMAGE_PATTERNS, LISTING_THREADS, Source, Split, file_names, is_image_file,
                               is_integer, read_text, sorted_names)
from tfdp.data.storage import filesystem, is_remote, url
from tfdp.errors import UserError, first_line

IMAGE_COLUMNS = ("file_name", "image", "filename", "path", "file")
LABEL_COLUMNS = ("label", "class", "category")
CLASSES = "classes.txt"


def csv_source(root: str, split_names: tuple[str, ...], labelled_splits: tuple[str, ...]) -> Source:
    """Each of `split_names` from its labels file (`labels_file`); the class list from `classes.txt`, or from the
    labels of `labelled_splits` (training's and validation's) wherever their files exist."""
    fs, path = filesystem(root)
    if not fs.isdir(path):
        raise UserError(f"data directory not found: {url(fs, path)}")
    found = {name: labels_file(fs, path, name) for name in dict.fromkeys((*split_names, *labelled_splits))}
    for name in split_names:
        if found[name] is None:
            raise UserError(f"data.format csv: no {name}.csv (nor {name}.jsonl, {name}/metadata.csv or .jsonl) in "
                            f"{url(fs, path)} (a labels file per split, naming its image and label columns)")
    rows = {name: read_rows(fs, path, *found[name]) for name in found if found[name] is not None}
    classes, index = class_list(fs, path, rows)
    splits = {}
    for name in split_names:
        files = [posixpath.join(path, image) for image, _, _ in rows[name]]
        check_present(fs, path, url(fs, found[name][0]), files, [line for _, _, line in rows[name]])
        splits[name] = Split(name=name, files=tuple(url(fs, f) for f in files),
                             labels=tuple(index[label] for _, label, _ in rows[name]))
    return Source(class_names=classes, splits=splits)


def labels_file(fs, root: str, split: str) -> tuple[str, str] | None:
    """(the split's labels file, the folder under root its image paths start from): `<split>.csv` or `.jsonl`
    (paths from root), or Hugging Face imagefolder's `<split>/metadata.csv` or `.jsonl` (paths from the split's
    folder); None: none of them."""
    places = [(posixpath.join(root, f"{split}{kind}"), "") for kind in LABELS_FILES]
    places += [(posixpath.join(root, split, f"metadata{kind}"), split) for kind in LABELS_FILES]
    for path, base in places:
        if fs.isfile(path):
            return path, base
    return None


def read_rows(fs, root: str, path: str, base: str) -> list[tuple[str, str, int]]:
    """(image path relative to root, label, line number) of every row of the labels file `path`, whose image paths
    start from `root/base`."""
    where = url(fs, path)
    text = read_text(fs, path).lstrip("\ufeff")
    rows = [(posixpath.join(base, _relative(image, where, line)), _label(label, where, line), line)
            for line, image, label in LABELS_FILES[posixpath.splitext(path)[1]](text, where)]
    if not rows:
        raise UserError(f"{where} lists no images")
    return rows


def _csv_rows(text: str, where: str):
    """(line number, image, label) of each row of a CSV file with a header."""
    reader = csv.reader(io.StringIO(text), delimiter=_delimiter(text.partition("\n")[0]))
    header = [name.strip().lower() for name in next(reader, [])]
    image_col, label_col = (_column(header, names, what, where) for names, what in
                            ((IMAGE_COLUMNS, "image"), (LABEL_COLUMNS, "label")))
    for line, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) <= max(image_col, label_col):
            raise UserError(f"{where}, line {line}: {len(row)} field(s), where the header has {len(header)}")
        yield line, row[image_col].strip(), row[label_col].strip()


def _jsonl_rows(text: str, where: str):
    """(line number, image, label) of each object of a JSON Lines file (Hugging Face's `metadata.jsonl`), its
    image and label keys found as a CSV header's columns are, in the first object."""
    keys = None
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise UserError(f"{where}, line {line}: not JSON ({first_line(e, 80)})") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}, line {line}: not a JSON object (each line holds one image's fields)")
        record = {str(k).strip().lower(): v for k, v in record.items()}
        if keys is None:
            names = list(record)
            keys = tuple(names[_column(names, columns, what, where, jsonl=True)] for columns, what in
                         ((IMAGE_COLUMNS, "image"), (LABEL_COLUMNS, "label")))
        image, label = (record.get(key, "") for key in keys)   # a missing one: as an empty CSV cell
        if not isinstance(image, str):
            raise UserError(f"{where}, line {line}: its {keys[0]} must be a path, not {json.dumps(image)}")
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise UserError(f"{where}, line {line}: its {keys[1]} must be a class name or number, not "
                            f"{json.dumps(label)}")
        yield line, image.strip(), str(label).strip()


def _delimiter(header: str) -> str:
    """A comma, or the semicolon or tab of a header that has one and no comma (spreadsheets set to a locale whose
    decimal mark is the comma write semicolons)."""
    if "," in header:
        return ","
    return next((d for d in (";", "\t") if d in header), ",")


def _column(header: list[str], names: tuple[str, ...], what: str, where: str, jsonl: bool = False) -> int:
    found = [name for name in names if name in header]
    if len(found) != 1:
        how = f"has {' and '.join(found)}" if found else "has none"
        whose, field = ("first object's keys", "key") if jsonl else ("header", "column")
        raise UserError(f"{where}: its {whose} ({','.join(header) or 'empty'}) must name one {what} {field} "
                        f"({', '.join(names)}); it {how}")
    return header.index(found[0])


def _relative(image: str, where: str, line: int) -> str:
    """The image's path under the folder the labels file names paths from, normalised; one that leaves it, or no
    image, is one line."""
    path = posixpath.normpath(image.replace("\\", "/")) if image else ""
    if not path or path.startswith(("/", "../")) or path == ".." or "://" in image:
        raise UserError(f"{where}, line {line}: image '{image}' is not a path inside the data directory "
                        f"(paths are relative to it)")
    if not is_image_file(path):
        raise UserError(f"{where}, line {line}: {image} is not an image TensorFlow decodes ({IMAGE_PATTERNS})")
    return path


def _label(label: str, where: str, line: int) -> str:
    if not label:
        raise UserError(f"{where}, line {line}: no label")
    return label


def class_list(fs, root: str, rows: dict[str, list[tuple[str, str, int]]]) -> tuple[tuple[str, ...], dict]:
    """(class names, label → index): classes.txt's names in its order, or every label's, sorted (as numbers where
    all are integers). With a classes.txt, labels are its names; where none is and every label is an integer
    below its length, they are indices into it (labels exported as numbers, their names kept apart)."""
    labels = {label for split in rows.values() for _, label, _ in split}
    classes_file = posixpath.join(root, CLASSES)
    if not fs.isfile(classes_file):
        classes = sorted_names(labels)
        return classes, {name: i for i, name in enumerate(classes)}
    classes = tuple(name.strip() for name in read_text(fs, classes_file).splitlines() if name.strip())
    duplicated = sorted({name for name in classes if classes.count(name) > 1})
    if duplicated:
        raise UserError(f"{url(fs, classes_file)} names {duplicated[0]} more than once")
    unknown = sorted(labels - set(classes))
    if not unknown:
        return classes, {name: i for i, name in enumerate(classes)}
    if not labels & set(classes) and all(is_integer(label) and 0 <= int(label) < len(classes) for label in labels):
        return classes, {label: int(label) for label in labels}
    raise UserError(f"{url(fs, classes_file)} lacks {len(unknown)} label(s) the csv files use (first: {unknown[0]}), "
                    f"which are neither its names nor indices into its {len(classes)} lines")


def check_present(fs, root: str, where: str, files: list[str], lines: list[int]) -> None:
    """Every listed image is in its folder: one listing per folder (concurrent in a bucket), not one look per
    image."""
    folders = sorted({posixpath.dirname(f) for f in files})
    lister = lambda folder: (folder, file_names(fs, folder))  # noqa: E731
    if is_remote(fs):
        with concurrent.futures.ThreadPoolExecutor(LISTING_THREADS) as pool:
            present = dict(pool.map(lister, folders))
    else:
        present = dict(map(lister, folders))
    missing = [(f, line) for f, line in zip(files, lines)
               if posixpath.basename(f) not in present[posixpath.dirname(f)]]
    if missing:
        first, line = missing[0]
        raise UserError(f"{where}: {len(missing)} of its {len(files)} images are not in {url(fs, root)} "
                        f"(first: {posixpath.relpath(first, root)}, line {line})")


# A labels file's reader by its extension, in the order `labels_file` looks for them.
LABELS_FILES = {".csv": _csv_rows, ".jsonl": _jsonl_rows}

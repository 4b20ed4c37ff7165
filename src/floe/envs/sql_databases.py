"""The small SQLite databases text2sql generates: their schemas, rows and atomic creation.

Each schema's rows are a pure function of a seed, so question templates can read the same facts
(names, cities, years) without touching the file, and a database file, once built, never has to
be rebuilt. A database is built in memory and written with ``floe.atomic`` (temporary sibling,
fsync, rename), so concurrent builders and crashes never leave a half-written database under the
final name.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from floe.atomic import atomic_write_bytes
from floe.envs.alphabet_sort import FIRST_NAMES, LAST_NAMES

SCHEMA_VERSION = 1  # bump when a schema or its row generator changes: the file name changes too

Rows = dict[str, list[dict]]

_CITIES = ("Lisbon", "Oslo", "Lyon", "Osaka", "Austin", "Porto", "Graz", "Leeds")
_COUNTRIES = ("Brazil", "Canada", "Germany", "India", "Japan", "Kenya", "Spain")
_DEPARTMENTS = ("Sales", "Research", "Support", "Finance", "Legal", "Marketing", "Design")
_PRODUCTS = {
    "Desk Lamp": "Home", "Kettle": "Home", "Pillow": "Home", "Rug": "Home",
    "Laptop": "Electronics", "Headphones": "Electronics", "Camera": "Electronics", "Monitor": "Electronics",
    "Novel": "Books", "Atlas": "Books", "Cookbook": "Books", "Comic": "Books",
    "Tent": "Outdoor", "Backpack": "Outdoor", "Bicycle": "Outdoor", "Kayak": "Outdoor",
}
_COURSES = ("Algebra", "Biology", "Chemistry", "History", "Music", "Physics", "Art", "Geography")


@dataclass(frozen=True)
class SchemaSpec:
    """One database layout: DDL, the column order of each table and its row generator."""

    name: str
    ddl: tuple[str, ...]
    columns: dict[str, tuple[str, ...]]
    make_rows: Callable[[random.Random], Rows]


def _people(rng: random.Random, count: int) -> list[str]:
    pool = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    return rng.sample(pool, count)


def _company_rows(rng: random.Random) -> Rows:
    departments = [
        {"id": i + 1, "name": name, "city": rng.choice(_CITIES)}
        for i, name in enumerate(rng.sample(_DEPARTMENTS, 5))
    ]
    salaries = rng.sample(range(30_000, 150_001, 1_000), 30)  # distinct, so "top k" has no ties
    employees = [
        {
            "id": i + 1,
            "name": name,
            # The first employees fill every department, so no department is empty and
            # "per department" questions mean the same with INNER or LEFT joins.
            "department_id": i + 1 if i < len(departments) else rng.randint(1, len(departments)),
            "salary": salaries[i],
            "hire_year": rng.randint(2010, 2024),
        }
        for i, name in enumerate(_people(rng, 30))
    ]
    return {"departments": departments, "employees": employees}


def _shop_rows(rng: random.Random) -> Rows:
    customers = [
        {"id": i + 1, "name": name, "country": rng.choice(_COUNTRIES)} for i, name in enumerate(_people(rng, 20))
    ]
    names = rng.sample(sorted(_PRODUCTS), 12)
    prices = rng.sample(range(5, 500), len(names))  # distinct prices
    products = [
        {"id": i + 1, "name": name, "category": _PRODUCTS[name], "price": prices[i]} for i, name in enumerate(names)
    ]
    orders = [
        {
            "id": i + 1,
            "customer_id": rng.randint(1, len(customers)),
            "product_id": rng.randint(1, len(products)),
            "quantity": rng.randint(1, 9),
            "order_year": rng.randint(2019, 2024),
        }
        for i in range(40)
    ]
    return {"customers": customers, "products": products, "orders": orders}


def _school_rows(rng: random.Random) -> Rows:
    students = [
        {"id": i + 1, "name": name, "grade": rng.randint(9, 12), "city": rng.choice(_CITIES)}
        for i, name in enumerate(_people(rng, 25))
    ]
    courses = [
        {"id": i + 1, "title": title, "credits": rng.randint(1, 5)} for i, title in enumerate(rng.sample(_COURSES, 6))
    ]
    by_course: dict[int, list[int]] = {c["id"]: [] for c in courses}
    for student in students:
        for course_id in rng.sample(sorted(by_course), rng.randint(2, 3)):
            by_course[course_id].append(student["id"])
    enrollments = []
    for course_id, student_ids in by_course.items():
        # Distinct scores within a course, so "best k students in a course" has no ties.
        for student_id, score in zip(student_ids, rng.sample(range(40, 101), len(student_ids))):
            enrollments.append({"student_id": student_id, "course_id": course_id, "score": score})
    return {"students": students, "courses": courses, "enrollments": enrollments}


SCHEMAS: dict[str, SchemaSpec] = {
    spec.name: spec
    for spec in (
        SchemaSpec(
            name="company",
            ddl=(
                "CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL)",
                ("CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                "department_id INTEGER NOT NULL REFERENCES departments(id), salary INTEGER NOT NULL, "
                "hire_year INTEGER NOT NULL)"),
            ),
            columns={
                "departments": ("id", "name", "city"),
                "employees": ("id", "name", "department_id", "salary", "hire_year"),
            },
            make_rows=_company_rows,
        ),
        SchemaSpec(
            name="shop",
            ddl=(
                "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT NOT NULL)",
                ("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, "
                "price INTEGER NOT NULL)"),
                ("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), "
                "product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL, "
                "order_year INTEGER NOT NULL)"),
            ),
            columns={
                "customers": ("id", "name", "country"),
                "products": ("id", "name", "category", "price"),
                "orders": ("id", "customer_id", "product_id", "quantity", "order_year"),
            },
            make_rows=_shop_rows,
        ),
        SchemaSpec(
            name="school",
            ddl=(
                ("CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, grade INTEGER NOT NULL, "
                "city TEXT NOT NULL)"),
                "CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, credits INTEGER NOT NULL)",
                ("CREATE TABLE enrollments (student_id INTEGER NOT NULL REFERENCES students(id), "
                "course_id INTEGER NOT NULL REFERENCES courses(id), score INTEGER NOT NULL, "
                "PRIMARY KEY (student_id, course_id))"),
            ),
            columns={
                "students": ("id", "name", "grade", "city"),
                "courses": ("id", "title", "credits"),
                "enrollments": ("student_id", "course_id", "score"),
            },
            make_rows=_school_rows,
        ),
    )
}


def schema_rows(schema: str, seed: int) -> Rows:
    """The rows of ``schema``'s database for ``seed`` (deterministic)."""
    return SCHEMAS[schema].make_rows(random.Random(f"floe.envs.text2sql/{schema}/{seed}"))


def db_id(schema: str, seed: int) -> str:
    return f"{schema}_s{seed}"


def ensure_database(schema: str, seed: int, db_dir: Path) -> Path:
    """The path of ``schema``'s database for ``seed`` in ``db_dir``, building it if absent."""
    path = db_dir / f"{db_id(schema, seed)}_v{SCHEMA_VERSION}.sqlite"
    if path.exists():
        return path
    spec, rows = SCHEMAS[schema], schema_rows(schema, seed)
    conn = sqlite3.connect(":memory:")
    try:
        with conn:
            for statement in spec.ddl:
                conn.execute(statement)
            for table, columns in spec.columns.items():
                marks = ", ".join("?" for _ in columns)
                conn.executemany(
                    f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})",
                    [tuple(row[c] for c in columns) for row in rows[table]],
                )
        image = conn.serialize()
    finally:
        conn.close()
    atomic_write_bytes(path, image)  # readers see no file or the whole file
    return path


def read_schema_ddl(path: Path) -> str:
    """The CREATE statements of the database at ``path`` (from sqlite_master), one per paragraph."""
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    try:
        found = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL ORDER BY name"
        ).fetchall()
    finally:
        conn.close()
    return "\n\n".join(f"{sql};" for (sql,) in found)

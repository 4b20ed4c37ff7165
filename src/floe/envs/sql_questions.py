"""Question templates for the generated text2sql databases: a question and its gold SQL.

Each template reads the database's rows (from ``sql_databases.schema_rows``) to pick concrete
values that exist, and covers one SQL skill: counting, filtering, joins, group-bys or ordering.
Templates avoid ambiguous answers (ties in "top k", empty groups) by construction of the data.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from floe.envs.sql_databases import Rows

Template = Callable[[random.Random, Rows], tuple[str, str]]


def _lit(value: str) -> str:
    """A SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


# --- company -------------------------------------------------------------------------------


def _company_hired_after(rng: random.Random, rows: Rows) -> tuple[str, str]:
    year = rng.randint(2012, 2022)
    return (f"How many employees were hired after {year}?", f"SELECT COUNT(*) FROM employees WHERE hire_year > {year}")


def _company_salary_above(rng: random.Random, rows: Rows) -> tuple[str, str]:
    threshold = rng.randrange(60_000, 130_001, 5_000)
    return (
        f"List the names of employees with a salary above {threshold}.",
        f"SELECT name FROM employees WHERE salary > {threshold}",
    )


def _company_in_department(rng: random.Random, rows: Rows) -> tuple[str, str]:
    dept = rng.choice(rows["departments"])["name"]
    return (
        f"Which employees work in the {dept} department?",
        ("SELECT e.name FROM employees e JOIN departments d ON e.department_id = d.id "
        f"WHERE d.name = {_lit(dept)}"),
    )


def _company_city_of(rng: random.Random, rows: Rows) -> tuple[str, str]:
    name = rng.choice(rows["employees"])["name"]
    return (
        f"In which city is the department of {name}?",
        ("SELECT d.city FROM employees e JOIN departments d ON e.department_id = d.id "
        f"WHERE e.name = {_lit(name)}"),
    )


def _company_per_department(rng: random.Random, rows: Rows) -> tuple[str, str]:
    return (
        "How many employees does each department have? Give the department name and the count.",
        "SELECT d.name, COUNT(*) FROM departments d JOIN employees e ON e.department_id = d.id GROUP BY d.name",
    )


def _company_top_paid(rng: random.Random, rows: Rows) -> tuple[str, str]:
    k = rng.randint(1, 5)
    return (
        "Who is the highest paid employee?" if k == 1 else f"Who are the {k} highest paid employees?",
        f"SELECT name FROM employees ORDER BY salary DESC LIMIT {k}",
    )


# --- shop ----------------------------------------------------------------------------------


def _shop_orders_in_year(rng: random.Random, rows: Rows) -> tuple[str, str]:
    year = rng.randint(2019, 2024)
    return (f"How many orders were placed in {year}?", f"SELECT COUNT(*) FROM orders WHERE order_year = {year}")


def _shop_products_in_category(rng: random.Random, rows: Rows) -> tuple[str, str]:
    category = rng.choice(rows["products"])["category"]
    return (
        f"List the names of the products in the {category} category.",
        f"SELECT name FROM products WHERE category = {_lit(category)}",
    )


def _shop_customers_from(rng: random.Random, rows: Rows) -> tuple[str, str]:
    country = rng.choice(rows["customers"])["country"]
    return (
        f"Which customers from {country} have placed at least one order?",
        ("SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
        f"WHERE c.country = {_lit(country)}"),
    )


def _shop_quantity_per_category(rng: random.Random, rows: Rows) -> tuple[str, str]:
    return (
        "What is the total quantity ordered in each product category? Give the category and the total.",
        "SELECT p.category, SUM(o.quantity) FROM orders o JOIN products p ON o.product_id = p.id GROUP BY p.category",
    )


def _shop_most_expensive(rng: random.Random, rows: Rows) -> tuple[str, str]:
    k = rng.randint(1, 5)
    question = "What is the most expensive product?" if k == 1 else f"What are the {k} most expensive products?"
    return (question, f"SELECT name FROM products ORDER BY price DESC LIMIT {k}")


def _shop_spent_by(rng: random.Random, rows: Rows) -> tuple[str, str]:
    buyers = sorted({o["customer_id"] for o in rows["orders"]})  # customers with orders: no NULL sum
    name = rows["customers"][rng.choice(buyers) - 1]["name"]
    return (
        f"How much has {name} spent in total (quantity times price)?",
        ("SELECT SUM(o.quantity * p.price) FROM orders o JOIN products p ON o.product_id = p.id "
        f"JOIN customers c ON o.customer_id = c.id WHERE c.name = {_lit(name)}"),
    )


# --- school --------------------------------------------------------------------------------


def _school_in_grade(rng: random.Random, rows: Rows) -> tuple[str, str]:
    grade = rng.randint(9, 12)
    return (f"How many students are in grade {grade}?", f"SELECT COUNT(*) FROM students WHERE grade = {grade}")


def _school_courses_over(rng: random.Random, rows: Rows) -> tuple[str, str]:
    credits = rng.randint(1, 4)
    return (
        f"List the titles of courses worth more than {credits} credits.",
        f"SELECT title FROM courses WHERE credits > {credits}",
    )


def _school_courses_of(rng: random.Random, rows: Rows) -> tuple[str, str]:
    name = rng.choice(rows["students"])["name"]
    return (
        f"Which courses is {name} enrolled in? Give the course titles.",
        ("SELECT c.title FROM enrollments e JOIN courses c ON e.course_id = c.id "
        f"JOIN students s ON e.student_id = s.id WHERE s.name = {_lit(name)}"),
    )


def _school_average_per_course(rng: random.Random, rows: Rows) -> tuple[str, str]:
    return (
        "What is the average score in each course? Give the course title and the average.",
        "SELECT c.title, AVG(e.score) FROM enrollments e JOIN courses c ON e.course_id = c.id GROUP BY c.title",
    )


def _school_best_in_course(rng: random.Random, rows: Rows) -> tuple[str, str]:
    title, k = rng.choice(rows["courses"])["title"], rng.randint(1, 3)
    return (
        f"Which student has the highest score in {title}?"
        if k == 1
        else f"Which {k} students have the highest scores in {title}?",
        ("SELECT s.name FROM enrollments e JOIN students s ON e.student_id = s.id "
        f"JOIN courses c ON e.course_id = c.id WHERE c.title = {_lit(title)} ORDER BY e.score DESC LIMIT {k}"),
    )


def _school_living_in(rng: random.Random, rows: Rows) -> tuple[str, str]:
    city = rng.choice(rows["students"])["city"]
    return (f"How many students live in {city}?", f"SELECT COUNT(*) FROM students WHERE city = {_lit(city)}")


TEMPLATES: dict[str, tuple[Template, ...]] = {
    "company": (
        _company_hired_after, _company_salary_above, _company_in_department,
        _company_city_of, _company_per_department, _company_top_paid,
    ),
    "shop": (
        _shop_orders_in_year, _shop_products_in_category, _shop_customers_from,
        _shop_quantity_per_category, _shop_most_expensive, _shop_spent_by,
    ),
    "school": (
        _school_in_grade, _school_courses_over, _school_courses_of,
        _school_average_per_course, _school_best_in_course, _school_living_in,
    ),
}

#!/usr/bin/env python3
"""The coefficients of the AVX2 double exponential (exp_in_range, detail/cpu/packet_exp.hpp).

That kernel reduces x = (n/2)·ln 2 + r with |r| <= ln 2 / 4 and forms e^r − 1 = r·P(r). P
interpolates (e^r − 1)/r at the Chebyshev nodes of [−a, a], a = 1.0001·ln 2 / 4 (the slack
covers the rounding of n), in 60 significant digits; the coefficients are then rounded to
double. The script prints them (highest power first, as the kernel's Horner scheme uses them),
the largest relative error of r·P(r) against e^r on a fine grid of [−a, a] with the rounded
coefficients (the fit's own error, before the kernel's roundings), and the correction for √2
rounded to a double. Needs mpmath (`pip install mpmath`).

    python3 scripts/fit_exp_polynomial.py [--degree 9]
"""
import argparse

import mpmath as mp


def fit(degree: int, half_width):
    """Monomial coefficients (lowest power first) of the interpolant of (e^r − 1)/r."""
    count = degree + 1
    nodes = [half_width * mp.cos(mp.pi * (k + mp.mpf(1) / 2) / count) for k in range(count)]
    vandermonde = mp.matrix([[x**j for j in range(count)] for x in nodes])
    values = mp.matrix([mp.expm1(x) / x for x in nodes])
    return list(mp.lu_solve(vandermonde, values))


def worst_relative_error(coefficients, half_width, points=4001):
    worst = mp.mpf(0)
    for i in range(points):
        r = -half_width + 2 * half_width * i / (points - 1)
        p = mp.mpf(0)
        for c in reversed(coefficients):
            p = p * r + mp.mpf(c)
        worst = max(worst, abs(r * p - mp.expm1(r)) / mp.exp(r))
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degree", type=int, default=9, help="degree of P (the kernel uses 9)")
    args = parser.parse_args()
    mp.mp.dps = 60
    half_width = mp.log(2) / 4 * mp.mpf("1.0001")
    rounded = [float(c) for c in fit(args.degree, half_width)]
    print(f"P of degree {args.degree} on |r| <= {mp.nstr(half_width, 8)}, highest power first:")
    for c in reversed(rounded):
        print(f"  {c!r}")
    error = worst_relative_error(rounded, half_width)
    print(f"largest relative error of r*P(r) against e^r: {mp.nstr(error, 4)} "
          f"({mp.nstr(error / mp.mpf(2)**-53, 3)} units of 2^-53)")
    root2 = mp.sqrt(2)
    root2_double = mp.mpf(float(root2))
    print(f"sqrt(2) as a double: {float(root2).hex()}, relative correction "
          f"{float((root2 - root2_double) / root2_double)!r}")


if __name__ == "__main__":
    main()

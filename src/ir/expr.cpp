#include "ir/expr.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace opfuse {
namespace {

Expr make(ExprNode::Kind k, std::vector<Expr> args) {
  auto n = std::make_shared<ExprNode>();
  n->kind = k;
  n->args = std::move(args);
  return n;
}

int64_t floordiv_int(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// Splits a product into its constant coefficient and the rest.
std::pair<int64_t, Expr> split_coeff(const Expr& e) {
  if (e->kind == ExprNode::Const) return {e->value, nullptr};
  if (e->kind == ExprNode::Mul && e->args[0]->kind == ExprNode::Const) {
    std::vector<Expr> rest(e->args.begin() + 1, e->args.end());
    return {e->args[0]->value, rest.size() == 1 ? rest[0] : make(ExprNode::Mul, rest)};
  }
  return {1, e};
}

bool less(const Expr& a, const Expr& b) { return to_string(a) < to_string(b); }

// A sum whose every non-constant term has a coefficient that y divides:
// sets *whole to the sum of those terms divided by y and *c to the
// constant. Then, for integer leaves, (y*w + c) // y == w + c // y and
// (y*w + c) % y == c % y: cat([x, x])[::2] has (2*s0 + 1)//2 = s0 rows.
bool multiple_plus_constant(const Expr& a, int64_t y, Expr* whole, int64_t* c) {
  if (a->kind != ExprNode::Add) return false;
  Expr w = nullptr;
  *c = 0;
  for (const Expr& t : a->args) {
    auto [k, rest] = split_coeff(t);
    if (!rest) {
      *c += k;
      continue;
    }
    if (k % y != 0) return false;
    Expr part = cst(k / y) * rest;
    w = w ? w + part : part;
  }
  if (!w) return false;
  *whole = w;
  return true;
}

}  // namespace

Expr cst(int64_t v) {
  auto n = std::make_shared<ExprNode>();
  n->kind = ExprNode::Const;
  n->value = v;
  return n;
}
Expr sym(const std::string& name) {
  auto n = std::make_shared<ExprNode>();
  n->kind = ExprNode::Sym;
  n->name = name;
  return n;
}
Expr var(const std::string& name) {
  auto n = std::make_shared<ExprNode>();
  n->kind = ExprNode::Var;
  n->name = name;
  return n;
}

bool is_const(const Expr& e, int64_t* v) {
  if (e->kind != ExprNode::Const) return false;
  if (v) *v = e->value;
  return true;
}

Expr operator+(const Expr& a, const Expr& b) {
  // Flatten, fold constants, merge like terms (same non-constant part).
  std::vector<Expr> terms;
  for (const Expr& x : {a, b}) {
    if (x->kind == ExprNode::Add) terms.insert(terms.end(), x->args.begin(), x->args.end());
    else terms.push_back(x);
  }
  int64_t c = 0;
  std::vector<std::pair<int64_t, Expr>> merged;
  for (const Expr& t : terms) {
    auto [k, rest] = split_coeff(t);
    if (!rest) { c += k; continue; }
    bool found = false;
    for (auto& m : merged)
      if (expr_equal(m.second, rest)) { m.first += k; found = true; break; }
    if (!found) merged.push_back({k, rest});
  }
  std::vector<Expr> out;
  for (auto& m : merged) {
    if (m.first == 0) continue;
    out.push_back(m.first == 1 ? m.second : cst(m.first) * m.second);
  }
  std::sort(out.begin(), out.end(), less);
  if (c != 0 || out.empty()) out.push_back(cst(c));
  if (out.size() == 1) return out[0];
  return make(ExprNode::Add, out);
}

Expr operator-(const Expr& a, const Expr& b) { return a + cst(-1) * b; }

Expr operator*(const Expr& a, const Expr& b) {
  std::vector<Expr> factors;
  for (const Expr& x : {a, b}) {
    if (x->kind == ExprNode::Mul) factors.insert(factors.end(), x->args.begin(), x->args.end());
    else factors.push_back(x);
  }
  // Products distribute over sums, so that every polynomial has exactly one
  // form (7*(s0 + 1)*s1 and (7*s0 + 7)*s1 are both 7*s0*s1 + 7*s1) and like
  // terms can merge.
  for (size_t i = 0; i < factors.size(); ++i) {
    if (factors[i]->kind != ExprNode::Add) continue;
    Expr rest = cst(1);
    for (size_t j = 0; j < factors.size(); ++j)
      if (j != i) rest = rest * factors[j];
    Expr sum = cst(0);
    for (const Expr& t : factors[i]->args) sum = sum + t * rest;
    return sum;
  }
  int64_t c = 1;
  std::vector<Expr> out;
  for (const Expr& f : factors) {
    if (f->kind == ExprNode::Const) c *= f->value;
    else out.push_back(f);
  }
  if (c == 0) return cst(0);
  std::sort(out.begin(), out.end(), less);
  if (out.empty()) return cst(c);
  if (c != 1) out.insert(out.begin(), cst(c));
  if (out.size() == 1) return out[0];
  return make(ExprNode::Mul, out);
}

Expr floordiv(const Expr& a, const Expr& b) {
  int64_t x, y;
  if (is_const(b, &y) && y == 1) return a;
  if (is_const(a, &x) && is_const(b, &y) && y != 0) return cst(floordiv_int(x, y));
  if (is_const(a, &x) && x == 0) return a;
  // (k*b) // b == k when the coefficient divides exactly.
  if (is_const(b, &y) && y > 0) {
    auto [k, rest] = split_coeff(a);
    if (rest && k % y == 0) return cst(k / y) * rest;
  }
  if (expr_equal(a, b)) return cst(1);
  Expr whole;
  int64_t c = 0;
  if (is_const(b, &y) && y > 0 && multiple_plus_constant(a, y, &whole, &c))
    return whole + cst(floordiv_int(c, y));
  // (x // p) // q == x // (p*q) for positive p and q (floor of a floor):
  // two slices by step 2 are s0//4, as PyTorch prints them, not s0//2//2.
  int64_t p;
  if (is_const(b, &y) && y > 0 && a->kind == ExprNode::FloorDiv && is_const(a->args[1], &p) && p > 0)
    return floordiv(a->args[0], cst(p * y));
  return make(ExprNode::FloorDiv, {a, b});
}

Expr mod(const Expr& a, const Expr& b) {
  int64_t x, y;
  if (is_const(b, &y) && y == 1) return cst(0);
  if (is_const(a, &x) && is_const(b, &y) && y != 0) return cst(x - floordiv_int(x, y) * y);
  if (is_const(a, &x) && x == 0) return a;
  if (expr_equal(a, b)) return cst(0);
  Expr whole;
  int64_t c = 0;
  if (is_const(b, &y) && y > 0 && multiple_plus_constant(a, y, &whole, &c)) return cst(c - floordiv_int(c, y) * y);
  return make(ExprNode::Mod, {a, b});
}

Expr emin(const Expr& a, const Expr& b) {
  int64_t x, y;
  if (is_const(a, &x) && is_const(b, &y)) return cst(std::min(x, y));
  if (expr_equal(a, b)) return a;
  return make(ExprNode::Min, {a, b});
}
Expr emax(const Expr& a, const Expr& b) {
  int64_t x, y;
  if (is_const(a, &x) && is_const(b, &y)) return cst(std::max(x, y));
  if (expr_equal(a, b)) return a;
  return make(ExprNode::Max, {a, b});
}

bool same_shape(const Shape& a, const Shape& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!expr_equal(a[i], b[i])) return false;
  return true;
}

bool expr_equal(const Expr& a, const Expr& b) {
  if (a == b) return true;
  if (a->kind != b->kind || a->value != b->value || a->name != b->name ||
      a->args.size() != b->args.size())
    return false;
  for (size_t i = 0; i < a->args.size(); ++i)
    if (!expr_equal(a->args[i], b->args[i])) return false;
  return true;
}

static std::string print(const Expr& e, bool parens);

// `//`, `%` and `*` share one precedence level and group to the left, so a
// quotient inside a product, and a product or quotient on the right of `//`
// or `%`, need parentheses to parse back as the same tree.
static std::string print_operand(const Expr& e, bool wrap_mul) {
  bool wrap = e->kind == ExprNode::FloorDiv || e->kind == ExprNode::Mod || (wrap_mul && e->kind == ExprNode::Mul);
  return wrap ? "(" + print(e, false) + ")" : print(e, true);
}

static std::string print(const Expr& e, bool parens) {
  switch (e->kind) {
    case ExprNode::Const: {
      std::string s = std::to_string(e->value);
      return (parens && e->value < 0) ? "(" + s + ")" : s;
    }
    case ExprNode::Sym: case ExprNode::Var: return e->name;
    case ExprNode::Add: {
      std::string s;
      for (size_t i = 0; i < e->args.size(); ++i) s += (i ? " + " : "") + print(e->args[i], false);
      return parens ? "(" + s + ")" : s;
    }
    case ExprNode::Mul: {
      std::string s;
      for (size_t i = 0; i < e->args.size(); ++i) s += (i ? "*" : "") + print_operand(e->args[i], false);
      return s;
    }
    case ExprNode::FloorDiv: return print(e->args[0], true) + "//" + print_operand(e->args[1], true);
    case ExprNode::Mod: return print(e->args[0], true) + "%" + print_operand(e->args[1], true);
    case ExprNode::Min: return "min(" + print(e->args[0], false) + ", " + print(e->args[1], false) + ")";
    case ExprNode::Max: return "max(" + print(e->args[0], false) + ", " + print(e->args[1], false) + ")";
  }
  return "?";
}

std::string to_string(const Expr& e) { return print(e, false); }

namespace {
struct ExprParser {
  const std::string& s;
  size_t i = 0;
  std::string err;
  void ws() { while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i; }
  bool eat(const char* t) {
    ws();
    size_t n = std::char_traits<char>::length(t);
    if (s.compare(i, n, t) == 0) { i += n; return true; }
    return false;
  }
  Expr sum() {
    Expr e = term();
    while (e) {
      if (eat("+")) { Expr r = term(); if (!r) return nullptr; e = e + r; }
      else if (s.compare(i, 1, "-") == 0 && (ws(), eat("-"))) { Expr r = term(); if (!r) return nullptr; e = e - r; }
      else break;
    }
    return e;
  }
  Expr term() {
    Expr e = atom();
    while (e) {
      if (eat("//")) { Expr r = atom(); if (!r) return nullptr; e = floordiv(e, r); }
      else if (eat("*")) { Expr r = atom(); if (!r) return nullptr; e = e * r; }
      else if (eat("%")) { Expr r = atom(); if (!r) return nullptr; e = mod(e, r); }
      else break;
    }
    return e;
  }
  Expr atom() {
    ws();
    if (i >= s.size()) { err = "unexpected end of expression"; return nullptr; }
    if (eat("(")) {
      Expr e = sum();
      if (!e) return nullptr;
      if (!eat(")")) { err = "expected ')'"; return nullptr; }
      return e;
    }
    if (eat("-")) { Expr e = atom(); return e ? cst(-1) * e : nullptr; }
    if (std::isdigit(static_cast<unsigned char>(s[i]))) {
      size_t j = i;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      int64_t v = std::stoll(s.substr(i, j - i));
      i = j;
      return cst(v);
    }
    if (std::isalpha(static_cast<unsigned char>(s[i])) || s[i] == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      std::string name = s.substr(i, j - i);
      i = j;
      if (name == "min" || name == "max") {
        if (!eat("(")) { err = "expected '(' after " + name; return nullptr; }
        Expr a = sum();
        if (!a || !eat(",")) { if (err.empty()) err = "expected ','"; return nullptr; }
        Expr b = sum();
        if (!b || !eat(")")) { if (err.empty()) err = "expected ')'"; return nullptr; }
        return name == "min" ? emin(a, b) : emax(a, b);
      }
      if (name[0] == 's' && name.size() > 1) return sym(name);
      return var(name);
    }
    err = std::string("unexpected character '") + s[i] + "' in expression";
    return nullptr;
  }
};
}  // namespace

Expr parse_expr(const std::string& text, std::string* error) {
  ExprParser p{text};
  Expr e = p.sum();
  p.ws();
  if (e && p.i != text.size()) { p.err = "trailing characters in expression '" + text + "'"; e = nullptr; }
  if (!e && error) *error = p.err;
  return e;
}

int64_t evaluate(const Expr& e, const std::map<std::string, int64_t>& env) {
  switch (e->kind) {
    case ExprNode::Const: return e->value;
    case ExprNode::Sym: case ExprNode::Var: {
      auto it = env.find(e->name);
      if (it == env.end()) throw std::runtime_error("unbound symbol '" + e->name + "'");
      return it->second;
    }
    case ExprNode::Add: { int64_t s = 0; for (auto& a : e->args) s += evaluate(a, env); return s; }
    case ExprNode::Mul: { int64_t s = 1; for (auto& a : e->args) s *= evaluate(a, env); return s; }
    case ExprNode::FloorDiv: {
      int64_t d = evaluate(e->args[1], env);
      if (d == 0) throw std::runtime_error("division by zero in size expression");
      return floordiv_int(evaluate(e->args[0], env), d);
    }
    case ExprNode::Mod: {
      int64_t a = evaluate(e->args[0], env), d = evaluate(e->args[1], env);
      if (d == 0) throw std::runtime_error("modulo by zero in size expression");
      return a - floordiv_int(a, d) * d;
    }
    case ExprNode::Min: return std::min(evaluate(e->args[0], env), evaluate(e->args[1], env));
    case ExprNode::Max: return std::max(evaluate(e->args[0], env), evaluate(e->args[1], env));
  }
  return 0;
}

Expr substitute(const Expr& e, const std::function<Expr(const ExprNode&)>& f) {
  switch (e->kind) {
    case ExprNode::Const: return e;
    case ExprNode::Sym: case ExprNode::Var: { Expr r = f(*e); return r ? r : e; }
    default: break;
  }
  std::vector<Expr> a;
  for (auto& x : e->args) a.push_back(substitute(x, f));
  switch (e->kind) {
    case ExprNode::Add: { Expr s = cst(0); for (auto& x : a) s = s + x; return s; }
    case ExprNode::Mul: { Expr s = cst(1); for (auto& x : a) s = s * x; return s; }
    case ExprNode::FloorDiv: return floordiv(a[0], a[1]);
    case ExprNode::Mod: return mod(a[0], a[1]);
    case ExprNode::Min: return emin(a[0], a[1]);
    case ExprNode::Max: return emax(a[0], a[1]);
    default: return e;
  }
}

namespace {
bool mentions(const Expr& e, const std::string& name) {
  if (e->kind == ExprNode::Sym) return e->name == name;
  for (auto& a : e->args)
    if (mentions(a, name)) return true;
  return false;
}
}  // namespace

bool linear_in(const Expr& e, const std::string& name) {
  if (e->kind == ExprNode::Sym) return e->name == name;
  if (e->kind == ExprNode::Add) {
    int linear = 0;
    for (auto& t : e->args) {
      if (!mentions(t, name)) continue;
      if (!linear_in(t, name)) return false;
      ++linear;
    }
    return linear == 1;
  }
  if (e->kind == ExprNode::Mul)  // a constant times the symbol (a product of sorted factors)
    return e->args.size() == 2 && e->args[0]->kind == ExprNode::Const && e->args[0]->value != 0 &&
           e->args[1]->kind == ExprNode::Sym && e->args[1]->name == name;
  return false;
}

void collect_symbols(const Expr& e, std::vector<std::string>* out) {
  if (e->kind == ExprNode::Sym) {
    if (std::find(out->begin(), out->end(), e->name) == out->end()) out->push_back(e->name);
    return;
  }
  for (auto& a : e->args) collect_symbols(a, out);
}

std::string to_c(const Expr& e, const std::function<std::string(const ExprNode&)>& leaf) {
  switch (e->kind) {
    case ExprNode::Const: return e->value < 0 ? "(" + std::to_string(e->value) + "LL)" : std::to_string(e->value) + "LL";
    case ExprNode::Sym: case ExprNode::Var: return leaf(*e);
    case ExprNode::Add: case ExprNode::Mul: {
      std::string s = "(";
      for (size_t i = 0; i < e->args.size(); ++i)
        s += (i ? (e->kind == ExprNode::Add ? " + " : " * ") : "") + to_c(e->args[i], leaf);
      return s + ")";
    }
    // Index arithmetic here is over non-negative values, where C's / and %
    // agree with floor division.
    case ExprNode::FloorDiv: return "(" + to_c(e->args[0], leaf) + " / " + to_c(e->args[1], leaf) + ")";
    case ExprNode::Mod: return "(" + to_c(e->args[0], leaf) + " % " + to_c(e->args[1], leaf) + ")";
    case ExprNode::Min: return "opf_imin(" + to_c(e->args[0], leaf) + ", " + to_c(e->args[1], leaf) + ")";
    case ExprNode::Max: return "opf_imax(" + to_c(e->args[0], leaf) + ", " + to_c(e->args[1], leaf) + ")";
  }
  return "0";
}

std::string shape_to_string(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + to_string(s[i]);
  return r + "]";
}

Expr numel(const Shape& s) {
  Expr n = cst(1);
  for (auto& d : s) n = n * d;
  return n;
}

}  // namespace opfuse

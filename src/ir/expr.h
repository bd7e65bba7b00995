// Symbolic integer expressions: tensor sizes (`s0*4096`) and, in the kernel
// IR, index arithmetic over loop variables. Built already simplified
// (constants folded, sums and products flattened and sorted), so two
// expressions are equal exactly when their printed forms are equal.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace opfuse {

struct ExprNode;
using Expr = std::shared_ptr<const ExprNode>;

struct ExprNode {
  enum Kind { Const, Sym, Var, Add, Mul, FloorDiv, Mod, Min, Max } kind;
  int64_t value = 0;       // Const
  std::string name;        // Sym (a size symbol) or Var (a loop variable)
  std::vector<Expr> args;  // Add/Mul: n-ary; FloorDiv/Mod/Min/Max: binary
};

Expr cst(int64_t v);
Expr sym(const std::string& name);
Expr var(const std::string& name);
Expr operator+(const Expr& a, const Expr& b);
Expr operator-(const Expr& a, const Expr& b);
Expr operator*(const Expr& a, const Expr& b);
Expr floordiv(const Expr& a, const Expr& b);
Expr mod(const Expr& a, const Expr& b);
Expr emin(const Expr& a, const Expr& b);
Expr emax(const Expr& a, const Expr& b);

bool is_const(const Expr& e, int64_t* v = nullptr);
bool expr_equal(const Expr& a, const Expr& b);
std::string to_string(const Expr& e);

// Parses the printed form: integers, names (s* are symbols, anything else a
// variable), + - * // % min(,) max(,) and parentheses. Returns nullptr and
// sets *error on bad input.
Expr parse_expr(const std::string& text, std::string* error);

// Evaluates with values for symbols and variables; throws on an unbound name.
int64_t evaluate(const Expr& e, const std::map<std::string, int64_t>& env);

// Replaces Var/Sym leaves for which `f` returns non-null.
Expr substitute(const Expr& e, const std::function<Expr(const ExprNode&)>& f);

// Whether e is c*name + (terms without name) with c a nonzero constant
// (so that a value of e gives name's).
bool linear_in(const Expr& e, const std::string& name);

// All symbol names occurring in e.
void collect_symbols(const Expr& e, std::vector<std::string>* out);

// Prints as C code, mapping each leaf name through `leaf`.
std::string to_c(const Expr& e, const std::function<std::string(const ExprNode&)>& leaf);

using Shape = std::vector<Expr>;

// Same rank and every dim expr_equal.
bool same_shape(const Shape& a, const Shape& b);
std::string shape_to_string(const Shape& s);
Expr numel(const Shape& s);

}  // namespace opfuse

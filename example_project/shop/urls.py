from django.contrib import admin
from django.urls import include, path

from shop import views

urlpatterns = [path("admin/", admin.site.urls)]
# The order views (shop/orders.py): checkout, photos, backfill, job status.
urlpatterns += [path("orders/", include("shop.orders"))]
# Enqueue on commit and poll the result (shop/views.py, docs/django-tasks.md).
urlpatterns += [
    path("order/", views.place_order, name="place_order"),
    path("receipts/<str:result_id>/", views.receipt_status, name="receipt_status"),
    path("results/<str:result_id>.json", views.result_json, name="result_json"),
]

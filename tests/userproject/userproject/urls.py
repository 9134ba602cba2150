from django.contrib import admin
from django.urls import path
from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/<int:order_id>/receipt/", views.send_receipt_view),
    path("orders/<int:order_id>/sync/", views.sync_order_view),
]
